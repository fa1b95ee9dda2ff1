/* mma_emu.h — an emulation, on the host, of the warp-level instructions the tensor-core attention
   uses, for test/test_mma_emul.cc (the warp-level rules) and test/test_mma_kernels.cc (the kernels).
   Include harness.h first.

   Written from the PTX ISA (release 8.7, docs.nvidia.com/cuda/parallel-thread-execution), not
   from the rules under test:
     - ldmatrix.sync.aligned.m8n8{.x1,.x2,.x4}{.trans}.shared.b16 ("Warp-level matrix load
       instruction: ldmatrix"): threads 0-7 give the row addresses of matrix 0, 8-15 of matrix 1,
       16-23 of 2, 24-31 of 3 (.x1 reads threads 0-7, .x2 threads 0-15); each row is 16 bytes (8
       b16 elements, 16-byte aligned); register m of a thread receives two elements of matrix m,
       at row laneid/4, columns 2*(laneid%4) and +1 (the first in the low half); .trans delivers
       the matrix read column-major, that is, the elements of stored column laneid/4 at stored rows
       2*(laneid%4) and +1.
     - mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 ("Matrix Fragments for mma.m16n8k16
       with floating point type"): groupID = %laneid >> 2, threadID_in_group = %laneid % 4;
         A a0..a7: row = groupID for a_i with 0 <= i < 2 || 4 <= i < 6, groupID + 8 otherwise;
                   col = threadID_in_group * 2 + (i & 1) for a_i with i < 4, + 8 for i >= 4;
         B b0..b3: row = threadID_in_group * 2 + (i & 1) for b_i with i < 2, + 8 for i >= 2;
                   col = groupID;
         C, D c0..c3: row = groupID for c_i with i < 2, groupID + 8 for i >= 2;
                   col = threadID_in_group * 2 + (i & 1).
       The products are summed exactly (double) and rounded once to fp32: the hardware's internal
       order is not specified, and the checks below use tolerances far above an fp32 rounding.
     - shfl.sync.bfly.b32: lane l reads lane l ^ b.
     - shared memory: 32 banks of 4 bytes; a warp's 16-byte accesses go in four phases of eight
       lanes (for ldmatrix: one 8x8 matrix per phase), conflict-free when the phase's eight
       addresses fall in eight different 16-byte bank groups (address / 16 mod 8). */
#ifndef PR_MMA_EMU_H
#define PR_MMA_EMU_H
#include <cmath>
#include <cstdint>
#include <cstring>

static inline float bf16_value(uint16_t b) {
    uint32_t u = (uint32_t)b << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}
/* Round to the nearest bf16, ties to even, by arithmetic (not by the bits the kernels use). */
static inline double emu_round_bf16(double x) {
    if (x == 0 || !std::isfinite(x)) return x;
    int e;
    std::frexp(x, &e);                        /* |x| in [2^(e-1), 2^e): 8 significant bits */
    double ulp = std::ldexp(1.0, e - 8);
    return std::nearbyint(x / ulp) * ulp;     /* the default rounding mode: to nearest, ties to even */
}
static inline uint16_t emu_bf16_bits(double x) {      /* x already a bf16 value */
    float f = (float)x;
    uint32_t u;
    memcpy(&u, &f, 4);
    return (uint16_t)(u >> 16);
}

static long emu_conflicts;   /* 16-byte phases whose eight addresses share a bank group */

static inline void emu_phase(const uint32_t *addr8) {
    int seen = 0;
    for (int i = 0; i < 8; i++) seen |= 1 << ((addr8[i] / 16) % 8);
    if (seen != 0xff) emu_conflicts++;
}

/* A warp's 4-byte accesses (32 lanes' byte addresses): conflict-free when no two lanes touch
   different words of one bank. */
static inline void emu_words(const uint32_t addr[32]) {
    for (int i = 0; i < 32; i++)
        for (int j = 0; j < i; j++)
            if ((addr[i] / 4) % 32 == (addr[j] / 4) % 32 && addr[i] / 4 != addr[j] / 4) {
                emu_conflicts++;
                return;
            }
}

/* ldmatrix: smem is the shared memory as b16 elements; addr the 32 lanes' byte addresses. */
static inline void emu_ldmatrix(uint32_t out[32][4], const uint16_t *smem, size_t smem_elems, const uint32_t addr[32], int num,
                         bool trans) {
    for (int m = 0; m < num; m++) {
        emu_phase(addr + 8 * m);
        for (int lane = 0; lane < 32; lane++) {
            uint32_t reg = 0;
            for (int half = 0; half < 2; half++) {
                int row = lane / 4, col = 2 * (lane % 4) + half;         /* the fragment's element */
                int srow = trans ? col : row, scol = trans ? row : col;  /* where it is stored */
                uint32_t a = addr[8 * m + srow];
                if (a % 16 || a / 2 + 8 > smem_elems) {
                    CHECK(0, "ldmatrix row address %u misaligned or outside shared memory", a);
                    return;
                }
                reg |= (uint32_t)smem[a / 2 + scol] << (16 * half);
            }
            out[lane][m] = reg;
        }
    }
}

/* The ISA's fragment tables, as written there. */
static inline void emu_a_pos(int lane, int i, int *row, int *col) {
    int groupID = lane >> 2, tig = lane % 4;
    *row = ((0 <= i && i < 2) || (4 <= i && i < 6)) ? groupID : groupID + 8;
    *col = i < 4 ? tig * 2 + (i & 0x1) : tig * 2 + (i & 0x1) + 8;
}
static inline void emu_b_pos(int lane, int i, int *row, int *col) {
    int groupID = lane >> 2, tig = lane % 4;
    *row = i < 2 ? tig * 2 + (i & 0x1) : tig * 2 + (i & 0x1) + 8;
    *col = groupID;
}
static inline void emu_c_pos(int lane, int i, int *row, int *col) {
    int groupID = lane >> 2, tig = lane % 4;
    *row = i < 2 ? groupID : groupID + 8;
    *col = tig * 2 + (i & 0x1);
}

/* Each lane register's element of A, B and C/D, from the tables above (one lookup a call, not
   three calls an element: the emulated kernels execute millions of mma). */
struct emu_frag_tables {
    unsigned char a[32][8][2], b[32][4][2], c[32][4][2];   /* [lane][i]: row, col */
    emu_frag_tables() {
        for (int lane = 0; lane < 32; lane++) {
            for (int i = 0; i < 8; i++) {
                int r, q;
                emu_a_pos(lane, i, &r, &q);
                a[lane][i][0] = (unsigned char)r, a[lane][i][1] = (unsigned char)q;
            }
            for (int i = 0; i < 4; i++) {
                int r, q;
                emu_b_pos(lane, i, &r, &q);
                b[lane][i][0] = (unsigned char)r, b[lane][i][1] = (unsigned char)q;
                emu_c_pos(lane, i, &r, &q);
                c[lane][i][0] = (unsigned char)r, c[lane][i][1] = (unsigned char)q;
            }
        }
    }
};

/* mma.m16n8k16 bf16 -> fp32: d = a b + c, per lane registers. Every element of D sums c, then
   the products in k order; the loop over k runs outside the one over the eight columns of a row,
   so that they accumulate together (the same sums, vectorised). */
static inline void emu_mma(float d[32][4], const uint32_t a[32][4], const uint32_t b[32][2], const float c[32][4]) {
    static const emu_frag_tables pos;
    double A[16][16], B[16][8], S[16][8];
    for (int lane = 0; lane < 32; lane++) {
        for (int i = 0; i < 8; i++)
            A[pos.a[lane][i][0]][pos.a[lane][i][1]] = bf16_value((uint16_t)(a[lane][i / 2] >> (16 * (i % 2))));
        for (int i = 0; i < 4; i++) {
            B[pos.b[lane][i][0]][pos.b[lane][i][1]] = bf16_value((uint16_t)(b[lane][i / 2] >> (16 * (i % 2))));
            S[pos.c[lane][i][0]][pos.c[lane][i][1]] = c[lane][i];
        }
    }
    for (int r = 0; r < 16; r++)
        for (int kk = 0; kk < 16; kk++)
            for (int q = 0; q < 8; q++) S[r][q] += A[r][kk] * B[kk][q];
    for (int lane = 0; lane < 32; lane++)
        for (int i = 0; i < 4; i++) d[lane][i] = (float)S[pos.c[lane][i][0]][pos.c[lane][i][1]];
}

#endif
