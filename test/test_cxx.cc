/* test_cxx.cc — the header dropped into a C++ program (C++17 or later): the implementation
   compiled as C++, one training step of the tiny model on the sample trace through both
   schedules, the in-process ranks (POSIX threads under C++) summing over two ranks, and the
   refusals a C++ caller meets. Ends with "N passed, N failed". */
#define PREFIXREUSE_IMPLEMENTATION
#include "../prefixreuse.h"
#include "harness.h"

#include <cmath>
#include <cstring>
#include <vector>

/* One reuse step and one baseline step from the same weights: finite losses that agree. */
static void test_step() {
    pr_error err;
    pr_config cfg;
    pr_trace trace;
    pr_trainer *tr = nullptr;
    std::memset(&trace, 0, sizeof trace);
    bool ok = !pr_config_load(&cfg, "model/tiny", &err) && !pr_trace_read(&trace, "data/sample.trace", &err) &&
              !pr_trainer_create(&tr, &cfg, pr_backend_cpu(), &err) && !pr_trainer_init_params(tr, 1234, &err);
    CHECK(ok, "set-up: %s", err.message);
    if (!ok) {
        pr_trace_free(&trace);
        pr_trainer_destroy(tr);
        return;
    }
    std::vector<pr_real> p0(pr_trainer_param_count(tr)), grads(p0.size());
    CHECK(!pr_trainer_get_params(tr, p0.data(), p0.size(), &err), "get_params: %s", err.message);

    pr_step_opts opt = pr_step_opts_default();
    pr_step_stats reuse, base;
    opt.schedule = PR_SCHEDULE_BASELINE;
    CHECK(!pr_trainer_compute_grads(tr, &trace.groups[0], &opt, &base, nullptr, &err), "baseline step: %s", err.message);
    opt.schedule = PR_SCHEDULE_REUSE;
    CHECK(!pr_trainer_compute_grads(tr, &trace.groups[0], &opt, &reuse, nullptr, &err), "reuse step: %s", err.message);
    CHECK(std::isfinite(reuse.loss) && std::isfinite(base.loss), "losses %g and %g finite", reuse.loss, base.loss);
    CHECK(std::fabs(reuse.loss - base.loss) <= 1e-5 * (1 + std::fabs(base.loss)), "reuse loss %.9g, baseline %.9g", reuse.loss,
          base.loss);
    CHECK(!pr_trainer_get_grads(tr, grads.data(), grads.size(), &err), "get_grads: %s", err.message);
    double norm = 0;
    for (pr_real g : grads) norm += (double)g * g;
    CHECK(std::isfinite(norm) && norm > 0, "gradient norm^2 %g finite and nonzero", norm);

    pr_adamw_opts adam = pr_adamw_opts_default();
    double grad_norm = 0;
    CHECK(!pr_trainer_adamw_step(tr, &adam, &grad_norm, &err), "AdamW: %s", err.message);
    std::vector<pr_real> p1(p0.size());
    CHECK(!pr_trainer_get_params(tr, p1.data(), p1.size(), &err), "get_params: %s", err.message);
    CHECK(p0 != p1 && std::isfinite(grad_norm), "the step moved the parameters (grad norm %g)", grad_norm);

    /* the refusals: a status and a message, never a crash */
    CHECK(pr_trainer_get_params(tr, nullptr, p0.size(), &err) == PR_ERR_ARG && std::strstr(err.message, "NULL buffer"),
          "NULL buffer: %s", err.message);
    CHECK(pr_trainer_config(nullptr) == nullptr && pr_trainer_param_count(nullptr) == 0, "neutral answers for NULL");
    pr_config big = cfg;
    big.num_hidden_layers = 100000000;
    pr_trainer *none = nullptr;
    CHECK(pr_trainer_create(&none, &big, pr_backend_cpu(), &err) == PR_ERR_CONFIG && none == nullptr &&
              std::strstr(err.message, "num_hidden_layers = 100000000 is larger than the limit"),
          "10^8 layers: %s", err.message);
    pr_trainer_destroy(tr);
    pr_trace_free(&trace);
}

#ifndef PR_NO_THREADS
/* Two in-process ranks (threads) sum their rank numbers plus one: 1 + 2 on each. */
static void test_ranks() {
    pr_error err;
    static double got[2];
    auto rank = [](pr_comm *c, void *, pr_error *e) -> pr_status {
        double x = c->rank + 1.0;
        pr_status st = c->all_reduce(c, &x, 1, PR_COMM_F64, e);
        got[c->rank] = x;
        return st;
    };
    CHECK(!pr_comm_local_run(2, rank, nullptr, &err), "two ranks: %s", err.message);
    CHECK(got[0] == 3 && got[1] == 3, "all_reduce over two threads: %g %g", got[0], got[1]);
}
#endif

int main() {
    test_step();
#ifndef PR_NO_THREADS
    test_ranks();
#endif
    return test_report();
}
