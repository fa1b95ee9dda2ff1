/* wgmma_emu.h - host emulation of the operand/result layouts of Hopper
 * wgmma.mma_async (sm_90a), bf16 inputs / f32 accumulators.
 * Written from the PTX ISA text only (no CUTLASS/CuTe/FlashAttention code),
 * as an independent reference for a kernel's own reading of the layouts.
 *
 * Sources actually read: PTX ISA (9.0) sections as markdown copies of
 *   https://docs.nvidia.com/cuda/parallel-thread-execution/
 *   (#asynchronous-warpgroup-level-matrix-fragment,
 *    #asynchronous-warpgroup-level-matrix-shared-memory-layout,
 *    #asynchronous-warpgroup-level-matrix-shared-memory-layout-matrix-descriptor,
 *    #tensor-swizzling-modes), copy in github.com/jIab-b/nvfp4_gemv-kernel
 *   ptx_llm/sections/9-7-15-5-1-register-fragments-and-shared-memory-matrix-
 *   layouts.md @017183ff; mirror https://ptx.poole.ai/docs/09-instruction-set/
 *   15-wgmma/mma-async/{register-fragments,shared-memory-layout.md}.
 *
 * [9.7.15.5.1.2.2 Matrix Descriptor Format] 64-bit value: bits 13-0
 *   encode(start address), 29-16 encode(leading dimension byte offset, LBO),
 *   45-32 encode(stride dimension byte offset, SBO), 51-49 "matrix base
 *   offset. This is valid for all swizzling modes except the no-swizzle mode",
 *   63-62 swizzle: 0 none, 1 128B, 2 64B, 3 32B; encode(x) = (x & 0x3FFFF) >> 4.
 *   "The value of base offset is 0 when the repeating pattern of the specified
 *   swizzling mode starts" at a 1024B (128B mode) / 512B (64B) / 256B (32B)
 *   boundary, otherwise base offset = (pattern start addr >> 0x7) & 0x7.
 * [9.7.15.5.1.2 Shared Memory Matrix Layout] imm-trans-a/-b = 0 -> K-major,
 *   = 1 -> M-major (A) / N-major (B). Swizzle atoms (in 128-bit elements,
 *   "multiplied along the leading dimension by 128/sizeof_bits"): 128B 8x8,
 *   64B MN 4x8 / K 8x4, 32B MN 2x8 / K 8x2, none MN 1x8 / K 8x1.
 * [..2.1.1 Leading Dimension Byte Offset] K-major: no-swizzle "offset from the
 *   first column to the second columns of the 8x2 tile in the 128-bit element
 *   type normalized matrix"; swizzled "not used, assumed to be 1".  MN-major:
 *   interleave "offset from the first 8 columns to the next 8 columns";
 *   swizzled "offset from the first (swizzle-byte-size/16) rows to the next
 *   (swizzle-byte-size/16) rows".
 * [..2.1.2 Stride Dimension Byte Offset] K-major: "offset from the first 8
 *   rows to the next 8 rows". MN-major: interleave "offset from the first row
 *   to the next row"; swizzled "offset from the first 8 columns to the next 8".
 * [..2.1.3 Canonical Layouts] (CuTe notation, T = 128/sizeof_bits(elem)):
 *   MN none  ((T,1,m),(8,k)):((1,T,SBO),(1T,LBO))   Swizzle<0,4,3>
 *   MN 32B   ((T,2,m),(8,k)):((1,T,LBO),(2T,SBO))   Swizzle<1,4,3>
 *   MN 64B   ((T,4,m),(8,k)):((1,T,LBO),(4T,SBO))   Swizzle<2,4,3>
 *   MN 128B  ((T,8,m),(8,k)):((1,T,LBO),(8T,SBO))   Swizzle<3,4,3>
 *   K  none  ((8,m),(T,2k)):((1T,SBO),(1,LBO))      Swizzle<0,4,3>
 *   K  32B   ((8,m),(T,2k)):((2T,SBO),(1,T))        Swizzle<1,4,3>
 *   K  64B   ((8,m),(T,2k)):((4T,SBO),(1,T))        Swizzle<2,4,3>
 *   K  128B  ((8,m),(T,2k)):((8T,SBO),(1,T))        Swizzle<3,4,3>
 *   (first mode = M/N index, second = K index; LBO/SBO there in elements,
 *   descriptor holds bytes>>4, per the worked bf16/tf32 examples).
 * [5.5.7 Swizzling Modes] tables in 16-byte cells, 8 cells per 128-byte line:
 *   32B (256B-aligned start): line 1 = 1 0 3 2 5 4 7 6 (cell ^ 1); 64B
 *   (512B-aligned): line r of 4 = cell ^ r; 128B/16B atomicity (1024B-aligned):
 *   line r of 8 = cell ^ r.  I.e. byte-address bits [4,4+B) ^= bits [7,7+B),
 *   B = 1/2/3, which is what Swizzle<B,4,3> denotes on byte addresses.
 * [9.7.15.5.1.1.1 Matrix Fragments for wgmma.mma_async.m64nNk16] A in regs:
 *   four .f16x2 registers, elements a0..a7 (low to high); D .f32: N/2 .f32
 *   registers d0..d(N/2-1).  The thread->(row,col) mapping itself is given
 *   ONLY as images (Figure 148 wgmma-64N16-A.png, Figure 149 -D.png), which
 *   were not viewable here; see emu_wgmma_{a,d}_coord for what was used.
 * [9.7.15.5.2 wgmma.mma_async] "Matrices A and B are stored in row-major and
 *   column-major format respectively"; imm-trans-a/-b = 1 transposes, "only
 *   supported for ... .f16/.bf16 types on matrices accessed from shared
 *   memory using matrix descriptors".
 */
#ifndef WGMMA_EMU_H
#define WGMMA_EMU_H
#include <cstdint>
#include <cstring>
#include <cstdio>

#define EMU_WGMMA_BAD 0xFFFFFFFFu

/* Byte address in shared memory of element (mn, k) of an A (mn = m, 0..63) or
 * B (mn = n) operand read through `desc`, for one instruction's K slice
 * (k*elem_bytes < 32: k 0..15 for bf16).  mn_major = imm-trans value.
 * Returns EMU_WGMMA_BAD for unsupported inputs (non-zero base offset with a
 * swizzled mode, MN-major with a non-16-bit type, out-of-range k). */
static inline uint32_t emu_wgmma_smem_addr(uint64_t desc, int mn, int k,
                                           int mn_major, int elem_bytes)
{
    if (elem_bytes != 1 && elem_bytes != 2 && elem_bytes != 4) return EMU_WGMMA_BAD;
    if (mn_major && elem_bytes != 2) return EMU_WGMMA_BAD; /* trans: f16/bf16 only */
    if (mn < 0 || k < 0 || k * elem_bytes >= 32) return EMU_WGMMA_BAD;
    const uint32_t start = (uint32_t)(desc & 0x3FFFu) << 4;          /* bits 13-0  */
    const uint32_t lbo = (uint32_t)((desc >> 16) & 0x3FFFu) << 4;    /* bits 29-16 */
    const uint32_t sbo = (uint32_t)((desc >> 32) & 0x3FFFu) << 4;    /* bits 45-32 */
    const uint32_t base_off = (uint32_t)((desc >> 49) & 0x7u);       /* bits 51-49 */
    const uint32_t mode = (uint32_t)((desc >> 62) & 0x3u);           /* bits 63-62 */
    static const uint32_t swz_bytes[4] = {0u, 128u, 64u, 32u};
    const uint32_t S = swz_bytes[mode];            /* swizzle-byte-size, 0 = none */
    const uint32_t eb = (uint32_t)elem_bytes;
    const uint32_t T = 16u / eb;                   /* elements per 128 bits */
    const uint32_t m = (uint32_t)mn, kk = (uint32_t)k;
    uint32_t off;
    if (S == 0) {
        /* No-swizzle / interleave: base offset field "valid for all swizzling
         * modes except the no-swizzle mode" -> ignored here. */
        if (!mn_major)  /* ((8,m),(T,2k)):((1T,SBO),(1,LBO)) */
            off = (m % 8u) * 16u + (m / 8u) * sbo + (kk % T) * eb + (kk / T) * lbo;
        else            /* ((T,1,m),(8,k)):((1,T,SBO),(1T,LBO)) */
            off = (m % T) * eb + (m / T) * sbo + (kk % 8u) * 16u + (kk / 8u) * lbo;
    } else {
        /* Only base offset 0 (pattern anchored at a 1024/512/256-byte
         * boundary) is emulated; a non-zero base offset is rejected. */
        if (base_off != 0) return EMU_WGMMA_BAD;
        if (!mn_major) {
            /* ((8,m),(T,2k)):(((S/16)T,SBO),(1,T)): rows S bytes apart inside
             * the 8-row atom, SBO between 8-row groups; K contiguous.
             * LBO: "not used, assumed to be 1" -> ignored. */
            off = (m % 8u) * S + (m / 8u) * sbo + kk * eb;
        } else {
            /* ((T,S/16,m),(8,k)):((1,T,LBO),((S/16)T,SBO)): MN contiguous for
             * S bytes (S/eb elements), LBO between such MN blocks; K rows S
             * bytes apart inside the atom, SBO between 8-K-row groups. */
            const uint32_t per = S / eb;
            off = (m % per) * eb + (m / per) * lbo + (kk % 8u) * S + (kk / 8u) * sbo;
        }
    }
    uint32_t addr = start + off;
    if (S != 0) {
        /* Swizzle<B,4,3> on the absolute byte address (B = log2(S/16)): the
         * 16-byte cell index (bits 4..6) is XORed with the 128-byte line index
         * (bits 7..9) modulo the pattern height S/16.  Using the absolute
         * address (not the offset from `start`) is what makes the pattern
         * repeat on 1024/512/256-byte boundaries, as the base-offset rule
         * states; the two agree whenever `start` is pattern-aligned. */
        const uint32_t mask = S / 16u - 1u;
        addr ^= ((addr >> 7) & mask) << 4;
    }
    return addr;
}

/* Accumulator D of wgmma.mma_async.m64nNk16.f32 (any N multiple of 8):
 * thread tid (0..127) register d_i (0..N/2-1) holds D[row][col].
 * Figure 149 (image only).  Mapping used: warp w = tid/32 owns rows
 * 16w..16w+15; within it the 16x8 pattern that PTX states in text for the
 * mma.m16n8k16 accumulator (9.7.14.5.8: groupID = laneid>>2,
 * threadID_in_group = laneid%4, row = groupID (c0,c1) / groupID+8 (c2,c3),
 * col = threadID_in_group*2 + (i&1)) repeated over N/8 column blocks, d_i
 * with i = 4*j + c in column block j. */
static inline void emu_wgmma_d_coord(int tid, int i, int *row, int *col)
{
    const int warp = (tid >> 5) & 3, lane = tid & 31;
    const int group = lane >> 2, tig = lane & 3;
    *row = 16 * warp + group + 8 * ((i >> 1) & 1);
    *col = 8 * (i >> 2) + 2 * tig + (i & 1);
}

/* Operand A from registers, .bf16, m64nNk16: register r (0..3), half h
 * (0 = low 16 bits, 1 = high), i = 2r + h = index of a_i ("low to high").
 * Figure 148 (image only).  Mapping used: warp w owns rows 16w..16w+15 and
 * within it the text formula of mma.m16n8k16 A (.f16/.bf16, 9.7.14.5.8):
 * row = groupID for a0,a1,a4,a5 / groupID+8 otherwise;
 * col = threadID_in_group*2 + (i&1) (+8 for i >= 4). */
static inline void emu_wgmma_a_coord(int tid, int i, int *row, int *col)
{
    const int warp = (tid >> 5) & 3, lane = tid & 31;
    const int group = lane >> 2, tig = lane & 3;
    *row = 16 * warp + group + 8 * ((i >> 1) & 1);
    *col = 2 * tig + (i & 1) + 8 * ((i >> 2) & 1);
}

#endif /* WGMMA_EMU_H */
