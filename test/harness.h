/* A minimal test harness: CHECK records a pass or a failure with its location; the program ends
   with the line "N passed, N failed" and a nonzero status when anything failed. */
#ifndef PR_TEST_HARNESS_H
#define PR_TEST_HARNESS_H
#include <stdio.h>

static int test_passed, test_failed;

#define CHECK(cond, ...)                                                        \
    do {                                                                        \
        if (cond) test_passed++;                                                \
        else {                                                                  \
            test_failed++;                                                      \
            printf("FAIL %s:%d: ", __FILE__, __LINE__);                         \
            printf(__VA_ARGS__);                                                \
            printf("\n");                                                       \
        }                                                                       \
    } while (0)

static int test_report(void) {
    printf("%d passed, %d failed\n", test_passed, test_failed);
    return test_failed ? 1 : 0;
}
#endif
