/* The CPU q2s expert kernel (moetier/kernels/cpu/experts.py loads it; build.py compiles it with
 * the host's C compiler, -march=native -fopenmp).
 *
 * A call computes P (token, expert) pairs, grouped by blob: out[p] = weight[p] * down(act(gate_up
 * x[token[p]])), reading each blob's q2s codes and scales in place (the pinned host tier's rows).
 * Activations are rounded to int8 per word of 16 columns (scale absmax / 127, round half up:
 * moe_ref.quant_words_ref, as the GPU's q2s GEMV does), so a row's dot product is integer work:
 * codes c in 0..3 times int8 activations, summed per word, then per word
 *   x_scale_w * ((b - a) * sum(c q) + (3a - b) * sum(bit1(c) q) - b * sum(q))
 * since L[c] = (-b, -a, +a, +b)[c] = -b + (b - a) c + (3a - b) bit1(c); then per group the E4M3
 * scale and per row the row scale. The activations are stored in four planes by code position
 * (plane j holds columns 4i + j at byte i), so byte i of a row's codes, unpacked into four planes
 * of 2-bit values, meets four contiguous activation vectors; a 4-byte lane of the dot product
 * (VPDPBUSD, or PMADDUBSW + PMADDWD on AVX2) then sums exactly one word.
 * AVX-512 path: ROWS rows at once, one inlined copy per (grid kind, group-scale kind) so the loop
 * has no per-word branches; code positions unpacked by one GF2P8AFFINEQB each where GFNI is
 * present; 16 decoded group scales reused for 2^shift steps; the block MT_AHEAD blocks on
 * prefetched into L2. Threads take guided (contiguous) runs of blocks of up to rows_per_task rows.
 * Needs K % 16 == 0 and group % 16 == 0 (experts.py checks; other shapes run elsewhere).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#include <immintrin.h>
#define MT_PATH 3
#elif defined(__AVX2__)
#include <immintrin.h>
#define MT_PATH 2
#else
#define MT_PATH 0
#endif

int mt_path(void) { return MT_PATH; }

static int last_team = 0; /* threads of the last kernel call's team (tests read it) */

int mt_last_team(void) { return last_team; }

/* layout of one q2s matrix inside a blob: byte offsets of codes, scales, row_scale, grid;
 * then rows N, columns K, group */
typedef struct {
    int64_t codes, scales, row_scale, grid, n, k, group;
} Matrix;

/* v [k] -> planes [4][k/4] int8 (plane j, byte i = column 4i + j), scale [k/16], qsum [k/16] */
static void quant_words(const float *v, int64_t k, int8_t *planes, float *scale, int32_t *qsum) {
    int64_t k4 = k / 4;
    for (int64_t w = 0; w < k / 16; w++) {
        float amax = 0.0f;
        for (int i = 0; i < 16; i++) {
            float m = fabsf(v[16 * w + i]);
            amax = m > amax ? m : amax;
        }
        float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
        int32_t s = 0;
        for (int i = 0; i < 16; i++) {
            int64_t col = 16 * w + i;
            float scaled = v[col] * inv;
            int32_t q = (int32_t)floorf(scaled + 0.5f);
            planes[(col & 3) * k4 + (col >> 2)] = (int8_t)q;
            s += q;
        }
        scale[w] = amax / 127.0f;
        qsum[w] = s;
    }
}

typedef struct {
    const int8_t *planes;
    const float *scale;
    const int32_t *qsum;
} Act;

#if MT_PATH == 3
/* 16 E4M3 bytes (in 16-bit lanes) -> their values / 256, without a table: moved into FP16's
 * bit layout (exponent and mantissa shifted up 7, sign to bit 15), FP16's exponent bias being 8
 * more than E4M3's (subnormals map onto subnormals); the caller's row sum takes the 256 */
static inline __m512 e4m3_512(__m256i v) {
    __m256i mag = _mm256_slli_epi16(_mm256_and_si256(v, _mm256_set1_epi16(0x7F)), 7);
    __m256i sign = _mm256_slli_epi16(_mm256_and_si256(v, _mm256_set1_epi16(0x80)), 8);
    return _mm512_cvtph_ps(_mm256_or_si256(mag, sign));
}

#elif MT_PATH == 2
static inline __m256 e4m3_256(__m256i v) {
    __m256i mag = _mm256_and_si256(v, _mm256_set1_epi32(0x7F));
    __m256i bits = _mm256_add_epi32(_mm256_slli_epi32(mag, 20), _mm256_set1_epi32(120 << 23));
    __m256 sub = _mm256_mul_ps(_mm256_cvtepi32_ps(mag), _mm256_set1_ps(1.0f / 512.0f));
    __m256i normal = _mm256_cmpgt_epi32(mag, _mm256_set1_epi32(7));
    __m256 out = _mm256_blendv_ps(sub, _mm256_castsi256_ps(bits), _mm256_castsi256_ps(normal));
    __m256i sign = _mm256_slli_epi32(_mm256_and_si256(v, _mm256_set1_epi32(0x80)), 24);
    return _mm256_castsi256_ps(_mm256_or_si256(_mm256_castps_si256(out), sign));
}

static inline __m256 group_scales_256(const uint8_t *scales, int64_t w0, int64_t per_group,
                                      const int32_t *gidx) {
    __m256i idx;
    if (per_group <= 8 && 8 % per_group == 0) {
        __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
        __m256i dup = per_group == 1 ? lanes : _mm256_srli_epi32(lanes, __builtin_ctzll(per_group));
        __m256i bytes = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(scales + w0 / per_group)));
        idx = _mm256_permutevar8x32_epi32(bytes, dup);
    } else if (per_group % 8 == 0) {
        idx = _mm256_set1_epi32(scales[w0 / per_group]);
    } else {
        __m256i gi = _mm256_loadu_si256((const __m256i *)(gidx + w0));
        idx = _mm256_and_si256(_mm256_i32gather_epi32((const int *)scales, gi, 1),
                               _mm256_set1_epi32(255));
    }
    return e4m3_256(idx);
}
#endif

#ifndef ROWS
#define ROWS 8 /* rows of one matrix computed together (each activation vector loaded once) */
#endif
#ifndef MT_SCHED
#define MT_SCHED guided /* contiguous runs of blocks per thread (the prefetches run ahead in them) */
#endif

#if MT_PATH == 3
#ifndef MT_PREFETCH
#define MT_PREFETCH 1
#endif
#ifndef MT_AHEAD
#define MT_AHEAD 2 /* prefetch distance, in blocks of ROWS rows */
#endif
#ifndef MT_HINT
#define MT_HINT _MM_HINT_T1 /* into L2: more lines in flight than L1's fill buffers */
#endif

/* the group scales (/ 256) of the 16 words from word w0, per `mode` (a constant in each copy of
 * dot512): 0 a scale a word; 2 one scale for all 16 (a group of 16k words: its index from gidx,
 * its value from the table); 3 gathered. (Mode 1, a scale per 2, 4, 8 or 16 words, is dot512's:
 * 16 scales decoded once serve the next 2^shift steps.) */
static inline __attribute__((always_inline)) __m512 scales16(const uint8_t *s, int64_t w0,
                                                             const int mode, const int32_t *gidx,
                                                             const float *lut) {
    if (mode == 0)
        return e4m3_512(_mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(s + w0))));
    if (mode == 2) return _mm512_set1_ps(lut[s[gidx[w0]]] * (1.0f / 256.0f));
    __m512i gi = _mm512_loadu_si512((const void *)(gidx + w0));
    __m512i idx = _mm512_and_si512(_mm512_i32gather_epi32(gi, (const void *)s, 1),
                                   _mm512_set1_epi32(255));
    return e4m3_512(_mm512_cvtepi32_epi16(idx));
}

/* code position j of every byte (0..3), and its high bit (0..1): one GF2P8AFFINEQB each (a bit
 * matrix per byte moving bits 2j, 2j + 1 to bits 0, 1) where GFNI is present, else shift and mask */
#if defined(__GFNI__) && !defined(MT_NO_GFNI)
#define PLANE(raw, j) \
    _mm512_gf2p8affine_epi64_epi8(raw, _mm512_set1_epi64((int64_t)((1ull << (2 * (j))) << 56 | (1ull << (2 * (j) + 1)) << 48)), 0)
#define BIT1(raw, j) _mm512_gf2p8affine_epi64_epi8(raw, _mm512_set1_epi64((int64_t)((1ull << (2 * (j) + 1)) << 56)), 0)
#else
#define PLANE(raw, j) _mm512_and_si512(_mm512_srli_epi16(raw, 2 * (j)), m3)
#define BIT1(raw, j) _mm512_and_si512(_mm512_srli_epi16(raw, 2 * (j) + 1), m1)
#endif

/* ROWS rows' dot products with np activations over the first vec_end code bytes of each row;
 * even, mode: constants in each inlined copy (no per-word branches). res[r * np + p], r < nr. */
static inline __attribute__((always_inline)) void dot512(
    const uint8_t *const *codes, const uint8_t *const *scales, int64_t vec_end, int64_t k4,
    int64_t ahead, int np, const Act *acts, float cb, float b, float c1, const int even,
    const int mode, int shift, const int32_t *gidx, const float *lut, int nr, float *res) {
    const __m512i m3 = _mm512_set1_epi8(3), m1 = _mm512_set1_epi8(1);
    const __m512i lanes = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512i dup = _mm512_srli_epi32(lanes, shift);
    (void)m1;
    for (int p = 0; p < np; p++) {
        __m512 acc[ROWS];
        for (int r = 0; r < ROWS; r++) acc[r] = _mm512_setzero_ps();
        const int8_t *x = acts[p].planes;
        __m512 span[ROWS]; /* mode 1: 16 group scales, decoded every 2^shift steps */
        for (int r = 0; r < ROWS; r++) span[r] = _mm512_setzero_ps();
        for (int64_t i = 0; i < vec_end; i += 64) {
            __m512i spread = dup; /* mode 1: which of span's scales each of the 16 words takes */
            if (mode == 1) {
                const int64_t t = (i / 64) & ((1 << shift) - 1);
                if (t == 0)
                    for (int r = 0; r < ROWS; r++)
                        span[r] = e4m3_512(_mm256_cvtepu8_epi16(
                            _mm_loadu_si128((const __m128i *)(scales[r] + ((i / 4) >> shift)))));
                spread = _mm512_srli_epi32(_mm512_add_epi32(lanes, _mm512_set1_epi32((int)(16 * t))), shift);
            }
            const __m512i x0 = _mm512_loadu_si512((const void *)(x + i));
            const __m512i x1 = _mm512_loadu_si512((const void *)(x + k4 + i));
            const __m512i x2 = _mm512_loadu_si512((const void *)(x + 2 * k4 + i));
            const __m512i x3 = _mm512_loadu_si512((const void *)(x + 3 * k4 + i));
            const __m512 xs = _mm512_loadu_ps(acts[p].scale + i / 4);
            const __m512 q = _mm512_cvtepi32_ps(_mm512_loadu_si512((const void *)(acts[p].qsum + i / 4)));
            const __m512 va = _mm512_mul_ps(_mm512_set1_ps(cb), xs);
            const __m512 vb = _mm512_mul_ps(_mm512_set1_ps(-b), _mm512_mul_ps(q, xs));
            const __m512 vc = _mm512_mul_ps(_mm512_set1_ps(c1), xs);
#pragma GCC unroll 16
            for (int r = 0; r < ROWS; r++) {
                if (MT_PREFETCH && p == 0) _mm_prefetch((const char *)(codes[r] + i + ahead), MT_HINT);
                const __m512i raw = _mm512_loadu_si512((const void *)(codes[r] + i));
                __m512i s = _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_and_si512(raw, m3), x0);
                s = _mm512_dpbusd_epi32(s, PLANE(raw, 1), x1);
                s = _mm512_dpbusd_epi32(s, PLANE(raw, 2), x2);
                s = _mm512_dpbusd_epi32(s, PLANE(raw, 3), x3);
                __m512 v = _mm512_fmadd_ps(va, _mm512_cvtepi32_ps(s), vb);
                if (!even) {
                    __m512i u = _mm512_dpbusd_epi32(_mm512_setzero_si512(), BIT1(raw, 0), x0);
                    u = _mm512_dpbusd_epi32(u, BIT1(raw, 1), x1);
                    u = _mm512_dpbusd_epi32(u, BIT1(raw, 2), x2);
                    u = _mm512_dpbusd_epi32(u, BIT1(raw, 3), x3);
                    v = _mm512_fmadd_ps(vc, _mm512_cvtepi32_ps(u), v);
                }
                const __m512 gs = mode == 1 ? _mm512_permutexvar_ps(spread, span[r])
                                            : scales16(scales[r], i / 4, mode, gidx, lut);
                acc[r] = _mm512_fmadd_ps(v, gs, acc[r]);
            }
        }
        for (int r = 0; r < nr; r++) res[r * np + p] = 256.0f * _mm512_reduce_add_ps(acc[r]);
    }
}
#endif

/* rows row0 .. row0 + nr - 1 (nr <= ROWS) of a q2s matrix against np activations:
 * res[r * np + p] (row scales applied). gidx: [k/16] int32, word w's group */
static void rows_dot(const uint8_t *blob, const Matrix *m, int64_t row0, int nr, const float *lut,
                     int np, const Act *acts, const int32_t *gidx, float *res) {
    const int64_t k = m->k, k4 = k / 4, per_group = m->group / 16;
    (void)per_group; /* (the vector paths use it) */
    const uint8_t *codes[ROWS], *scales[ROWS];
    float row_scale[ROWS], a, b;
    for (int r = 0; r < nr; r++) {
        codes[r] = blob + m->codes + (row0 + r) * k4;
        scales[r] = blob + m->scales + (row0 + r) * (k / m->group);
        memcpy(&row_scale[r], blob + m->row_scale + 4 * (row0 + r), 4);
    }
    memcpy(&a, blob + m->grid, 4);
    memcpy(&b, blob + m->grid + 4, 4);
    const int even = (b - 3.0f * a) == 0.0f;
    const float cb = b - a, c1 = 3.0f * a - b;
    int64_t vec_end = 0;
#if MT_PATH == 3
    vec_end = k4 / 64 * 64;
    if (vec_end > 0) {
        const uint8_t *c4[ROWS], *s4[ROWS];
        for (int r = 0; r < ROWS; r++) { /* rows past nr repeat row 0 (their sums are dropped) */
            c4[r] = codes[r < nr ? r : 0];
            s4[r] = scales[r < nr ? r : 0];
        }
        int mode, shift = 0;
        if (per_group == 1) {
            mode = 0;
        } else if (per_group <= 16 && 16 % per_group == 0) {
            mode = 1;
            shift = __builtin_ctzll(per_group);
        } else if (per_group % 16 == 0) {
            mode = 2;
        } else {
            mode = 3;
        }
        const int64_t ahead = MT_AHEAD * ROWS * k4; /* the next block's codes, fetched while these run */
        switch (mode + 4 * even) {
        case 0: dot512(c4, s4, vec_end, k4, ahead, np, acts, cb, b, c1, 0, 0, shift, gidx, lut, nr, res); break;
        case 1: dot512(c4, s4, vec_end, k4, ahead, np, acts, cb, b, c1, 0, 1, shift, gidx, lut, nr, res); break;
        case 2: dot512(c4, s4, vec_end, k4, ahead, np, acts, cb, b, c1, 0, 2, shift, gidx, lut, nr, res); break;
        case 3: dot512(c4, s4, vec_end, k4, ahead, np, acts, cb, b, c1, 0, 3, shift, gidx, lut, nr, res); break;
        case 4: dot512(c4, s4, vec_end, k4, ahead, np, acts, cb, b, c1, 1, 0, shift, gidx, lut, nr, res); break;
        case 5: dot512(c4, s4, vec_end, k4, ahead, np, acts, cb, b, c1, 1, 1, shift, gidx, lut, nr, res); break;
        case 6: dot512(c4, s4, vec_end, k4, ahead, np, acts, cb, b, c1, 1, 2, shift, gidx, lut, nr, res); break;
        default: dot512(c4, s4, vec_end, k4, ahead, np, acts, cb, b, c1, 1, 3, shift, gidx, lut, nr, res); break;
        }
    } else {
        for (int r = 0; r < nr; r++)
            for (int p = 0; p < np; p++) res[r * np + p] = 0.0f;
    }
#elif MT_PATH == 2
    vec_end = k4 / 32 * 32;
    const __m256i m3 = _mm256_set1_epi8(3), m1 = _mm256_set1_epi8(1), ones = _mm256_set1_epi16(1);
    for (int p = 0; p < np; p++) {
        __m256 acc[ROWS];
        for (int r = 0; r < ROWS; r++) acc[r] = _mm256_setzero_ps();
        const int8_t *x = acts[p].planes;
        for (int64_t i = 0; i < vec_end; i += 32) {
            __m256i x0 = _mm256_loadu_si256((const __m256i *)(x + i));
            __m256i x1 = _mm256_loadu_si256((const __m256i *)(x + k4 + i));
            __m256i x2 = _mm256_loadu_si256((const __m256i *)(x + 2 * k4 + i));
            __m256i x3 = _mm256_loadu_si256((const __m256i *)(x + 3 * k4 + i));
            __m256 xs = _mm256_loadu_ps(acts[p].scale + i / 4);
            __m256 q = _mm256_cvtepi32_ps(_mm256_loadu_si256((const __m256i *)(acts[p].qsum + i / 4)));
            __m256 va = _mm256_mul_ps(_mm256_set1_ps(cb), xs);
            __m256 vb = _mm256_mul_ps(_mm256_set1_ps(-b), _mm256_mul_ps(q, xs));
            __m256 vc = _mm256_mul_ps(_mm256_set1_ps(c1), xs);
            for (int r = 0; r < nr; r++) {
                __m256i raw = _mm256_loadu_si256((const __m256i *)(codes[r] + i));
                /* u8 (0..3) x s8 pairs summed in int16 (at most 4 * 2 * 3 * 127: no saturation) */
                __m256i t = _mm256_add_epi16(
                    _mm256_maddubs_epi16(_mm256_and_si256(raw, m3), x0),
                    _mm256_maddubs_epi16(_mm256_and_si256(_mm256_srli_epi16(raw, 2), m3), x1));
                t = _mm256_add_epi16(t, _mm256_add_epi16(
                    _mm256_maddubs_epi16(_mm256_and_si256(_mm256_srli_epi16(raw, 4), m3), x2),
                    _mm256_maddubs_epi16(_mm256_and_si256(_mm256_srli_epi16(raw, 6), m3), x3)));
                __m256 v = _mm256_fmadd_ps(va, _mm256_cvtepi32_ps(_mm256_madd_epi16(t, ones)), vb);
                if (!even) {
                    __m256i u = _mm256_add_epi16(
                        _mm256_maddubs_epi16(_mm256_and_si256(_mm256_srli_epi16(raw, 1), m1), x0),
                        _mm256_maddubs_epi16(_mm256_and_si256(_mm256_srli_epi16(raw, 3), m1), x1));
                    u = _mm256_add_epi16(u, _mm256_add_epi16(
                        _mm256_maddubs_epi16(_mm256_and_si256(_mm256_srli_epi16(raw, 5), m1), x2),
                        _mm256_maddubs_epi16(_mm256_and_si256(_mm256_srli_epi16(raw, 7), m1), x3)));
                    v = _mm256_fmadd_ps(vc, _mm256_cvtepi32_ps(_mm256_madd_epi16(u, ones)), v);
                }
                acc[r] = _mm256_fmadd_ps(v, group_scales_256(scales[r], i / 4, per_group, gidx), acc[r]);
            }
        }
        for (int r = 0; r < nr; r++) {
            float lanes[8], sum = 0.0f;
            _mm256_storeu_ps(lanes, acc[r]);
            for (int l = 0; l < 8; l++) sum += lanes[l];
            res[r * np + p] = sum;
        }
    }
#else
    for (int r = 0; r < nr; r++)
        for (int p = 0; p < np; p++) res[r * np + p] = 0.0f;
#endif
    for (int r = 0; r < nr; r++) {
        for (int64_t i = vec_end; i < k4; i += 4) { /* the rest, one word (4 code bytes) at a time */
            const float gs = lut[scales[r][gidx[i / 4]]];
            for (int p = 0; p < np; p++) {
                const int8_t *x = acts[p].planes;
                int32_t s = 0, s1 = 0;
                for (int64_t j = i; j < i + 4; j++) {
                    int c = codes[r][j];
                    for (int pl = 0; pl < 4; pl++) {
                        int code = (c >> (2 * pl)) & 3;
                        s += code * x[pl * k4 + j];
                        s1 += (code >> 1) * x[pl * k4 + j];
                    }
                }
                float v = cb * (float)s + (-b) * (float)acts[p].qsum[i / 4];
                if (!even) v = c1 * (float)s1 + v;
                res[r * np + p] += v * (gs * acts[p].scale[i / 4]);
            }
        }
        for (int p = 0; p < np; p++) res[r * np + p] *= row_scale[r];
    }
}

static void group_index(const Matrix *m, int32_t *gidx) {
    for (int64_t w = 0; w < m->k / 16; w++) gidx[w] = (int32_t)(w / (m->group / 16));
}

/* rows of a work item: rows_per_task, fewer where that would leave fewer than 4 items a thread
 * (a call of few experts on many cores), a multiple of ROWS */
static int64_t task_rows(int64_t rows_per_task, int64_t rows, int64_t n_blobs, int team) {
    int64_t most = rows * n_blobs / (4 * (int64_t)team) / ROWS * ROWS;
    int64_t r = rows_per_task < most ? rows_per_task : most;
    return r > ROWS ? r : ROWS;
}

static float activation(float gate, float up, int kind, float alpha, float limit) {
    if (kind == 1 || kind == 2) {
        gate = gate < limit ? gate : limit;
        up = up < limit ? (up > -limit ? up : -limit) : limit;
    }
    if (kind == 2) return (up + 1.0f) * (gate / (1.0f + expf(-gate * alpha)));
    return gate / (1.0f + expf(-gate)) * up;
}

/* The kernel. blobs: address of each blob; start [B + 1]: blob b's pairs are start[b] ..
 * start[b + 1] - 1; token, weight [P]; x [T][H] float32; layouts of gate_up and down; bias
 * offsets in the blob (-1: none; float32); lut: the 256 E4M3 values; act 0 silu, 1 silu_clamped,
 * 2 gpt_oss; out [P][H]. Returns 0, or -1 when scratch memory could not be allocated. */
int mt_q2s_experts(int64_t n_blobs, const int64_t *blobs, const int64_t *start,
                   const int64_t *token, const float *weight, int64_t n_tokens, const float *x,
                   const int64_t *gate_up, const int64_t *down, int64_t gate_up_bias,
                   int64_t down_bias, const float *lut, int act, float alpha, float limit,
                   int64_t rows_per_task, int threads, float *out) {
    const Matrix gu = {gate_up[0], gate_up[1], gate_up[2], gate_up[3], gate_up[4], gate_up[5],
                       gate_up[6]};
    const Matrix dn = {down[0], down[1], down[2], down[3], down[4], down[5], down[6]};
    const int64_t hidden = gu.k, inter = dn.k, pairs = start[n_blobs];
    int8_t *xp = malloc(n_tokens * hidden + 64);
    float *xs = malloc(sizeof(float) * n_tokens * (hidden / 16) + 64);
    int32_t *xq = malloc(sizeof(int32_t) * n_tokens * (hidden / 16) + 64);
    float *h = malloc(sizeof(float) * pairs * inter + 64);
    int8_t *hp = malloc(pairs * inter + 64);
    float *hs = malloc(sizeof(float) * pairs * (inter / 16) + 64);
    int32_t *hq = malloc(sizeof(int32_t) * pairs * (inter / 16) + 64);
    int64_t most = 1; /* the most pairs of one blob */
    for (int64_t b = 0; b < n_blobs; b++)
        if (start[b + 1] - start[b] > most) most = start[b + 1] - start[b];
    int failed = !xp || !xs || !xq || !h || !hp || !hs || !hq;
    const int team = threads > 0 ? threads : omp_get_max_threads();
    const int64_t gu_rows = task_rows(rows_per_task, inter, n_blobs, team);
    const int64_t dn_rows = task_rows(rows_per_task, hidden, n_blobs, team);
    const int64_t gu_items = n_blobs * ((inter + gu_rows - 1) / gu_rows);
    const int64_t dn_items = n_blobs * ((hidden + dn_rows - 1) / dn_rows);
    if (!failed) {
#pragma omp parallel num_threads(threads)
        {
#pragma omp single
            last_team = omp_get_num_threads();
            Act *acts = malloc(sizeof(Act) * most);
            float *res = malloc(sizeof(float) * 2 * ROWS * most);
            int32_t *gidx = malloc(sizeof(int32_t) * ((hidden > inter ? hidden : inter) / 16 + 16));
            int ok = acts && res && gidx;
            if (!ok) {
#pragma omp atomic write
                failed = 1;
            }
#pragma omp for schedule(static)
            for (int64_t t = 0; t < n_tokens; t++)
                quant_words(x + t * hidden, hidden, xp + t * hidden, xs + t * (hidden / 16),
                            xq + t * (hidden / 16));
            if (ok) group_index(&gu, gidx);
#pragma omp for schedule(MT_SCHED)
            for (int64_t item = 0; item < gu_items; item++) {
                if (!ok) continue;
                const int64_t per = gu_items / n_blobs, b = item / per, block = item % per;
                const uint8_t *blob = (const uint8_t *)(intptr_t)blobs[b];
                const int np = (int)(start[b + 1] - start[b]);
                for (int p = 0; p < np; p++) {
                    const int64_t t = token[start[b] + p];
                    acts[p].planes = xp + t * hidden;
                    acts[p].scale = xs + t * (hidden / 16);
                    acts[p].qsum = xq + t * (hidden / 16);
                }
                const int64_t last = (block + 1) * gu_rows < inter ? (block + 1) * gu_rows : inter;
                for (int64_t r0 = block * gu_rows; r0 < last; r0 += ROWS) {
                    const int nr = (int)(last - r0 < ROWS ? last - r0 : ROWS);
                    rows_dot(blob, &gu, r0, nr, lut, np, acts, gidx, res);
                    rows_dot(blob, &gu, inter + r0, nr, lut, np, acts, gidx, res + ROWS * most);
                    for (int r = 0; r < nr; r++) {
                        for (int p = 0; p < np; p++) {
                            float g = res[r * np + p], u = res[ROWS * most + r * np + p];
                            if (gate_up_bias >= 0) {
                                float bg, bu;
                                memcpy(&bg, blob + gate_up_bias + 4 * (r0 + r), 4);
                                memcpy(&bu, blob + gate_up_bias + 4 * (inter + r0 + r), 4);
                                g += bg;
                                u += bu;
                            }
                            h[(start[b] + p) * inter + r0 + r] = activation(g, u, act, alpha, limit);
                        }
                    }
                }
            }
#pragma omp for schedule(static)
            for (int64_t p = 0; p < pairs; p++)
                quant_words(h + p * inter, inter, hp + p * inter, hs + p * (inter / 16),
                            hq + p * (inter / 16));
            if (ok) group_index(&dn, gidx);
#pragma omp for schedule(MT_SCHED)
            for (int64_t item = 0; item < dn_items; item++) {
                if (!ok) continue;
                const int64_t per = dn_items / n_blobs, b = item / per, block = item % per;
                const uint8_t *blob = (const uint8_t *)(intptr_t)blobs[b];
                const int np = (int)(start[b + 1] - start[b]);
                for (int p = 0; p < np; p++) {
                    const int64_t q = start[b] + p;
                    acts[p].planes = hp + q * inter;
                    acts[p].scale = hs + q * (inter / 16);
                    acts[p].qsum = hq + q * (inter / 16);
                }
                const int64_t last = (block + 1) * dn_rows < hidden ? (block + 1) * dn_rows : hidden;
                for (int64_t r0 = block * dn_rows; r0 < last; r0 += ROWS) {
                    const int nr = (int)(last - r0 < ROWS ? last - r0 : ROWS);
                    rows_dot(blob, &dn, r0, nr, lut, np, acts, gidx, res);
                    for (int r = 0; r < nr; r++) {
                        float bias = 0.0f;
                        if (down_bias >= 0) memcpy(&bias, blob + down_bias + 4 * (r0 + r), 4);
                        for (int p = 0; p < np; p++)
                            out[(start[b] + p) * hidden + r0 + r] =
                                (res[r * np + p] + bias) * weight[start[b] + p];
                    }
                }
            }
            free(acts);
            free(res);
            free(gidx);
        }
    }
    free(xp);
    free(xs);
    free(xq);
    free(h);
    free(hp);
    free(hs);
    free(hq);
    return failed ? -1 : 0;
}

static const int64_t *sort_keys;

static int by_blob(const void *l, const void *r) {
    int64_t a = *(const int64_t *)l, b = *(const int64_t *)r;
    if (sort_keys[a] != sort_keys[b]) return sort_keys[a] < sort_keys[b] ? -1 : 1;
    return a < b ? -1 : (a > b);
}

/* The entry point: P pairs in any order, pair p reading the blob at address pair_blob[p];
 * out [P][H] in the same order. Pairs are grouped by blob here (sorted by address). */
int mt_q2s_pairs(int64_t n_pairs, const int64_t *pair_blob, const int64_t *pair_token,
                 const float *pair_weight, int64_t n_tokens, const float *x,
                 const int64_t *gate_up, const int64_t *down, int64_t gate_up_bias,
                 int64_t down_bias, const float *lut, int act, float alpha, float limit,
                 int64_t rows_per_task, int threads, float *out) {
    const int64_t hidden = gate_up[5];
    int64_t *order = malloc(sizeof(int64_t) * (n_pairs + 1));
    int64_t *blobs = malloc(sizeof(int64_t) * (n_pairs + 1));
    int64_t *start = malloc(sizeof(int64_t) * (n_pairs + 2));
    int64_t *token = malloc(sizeof(int64_t) * (n_pairs + 1));
    float *weight = malloc(sizeof(float) * (n_pairs + 1));
    float *sorted = malloc(sizeof(float) * (n_pairs * hidden + 1));
    int status = -1;
    if (order && blobs && start && token && weight && sorted) {
        for (int64_t p = 0; p < n_pairs; p++) order[p] = p;
        sort_keys = pair_blob; /* (one caller at a time: the Python wrapper holds a lock) */
        qsort(order, (size_t)n_pairs, sizeof(int64_t), by_blob);
        int64_t n_blobs = 0;
        for (int64_t q = 0; q < n_pairs; q++) {
            const int64_t p = order[q];
            if (q == 0 || pair_blob[p] != pair_blob[order[q - 1]]) {
                blobs[n_blobs] = pair_blob[p];
                start[n_blobs++] = q;
            }
            token[q] = pair_token[p];
            weight[q] = pair_weight[p];
        }
        start[n_blobs] = n_pairs;
        status = mt_q2s_experts(n_blobs, blobs, start, token, weight, n_tokens, x, gate_up, down,
                                gate_up_bias, down_bias, lut, act, alpha, limit, rows_per_task,
                                threads, sorted);
        if (status == 0)
            for (int64_t q = 0; q < n_pairs; q++)
                memcpy(out + order[q] * hidden, sorted + q * hidden, sizeof(float) * hidden);
    }
    free(order);
    free(blobs);
    free(start);
    free(token);
    free(weight);
    free(sorted);
    return status;
}

/* The host node of a captured decode step (moetier/kernels/cpu/graph_part.py): one MoE layer's
 * CPU pairs, packed on the device into pinned buffers this struct points at. The first *count
 * entries of pair (token * top_k + k), blob (address) and weight name the pairs; x [tokens][H]
 * holds the layer's hidden rows in float32. out [tokens][top_k][H] gets each packed pair's row
 * and zero for every other pair. Same arithmetic as mt_q2s_pairs. A CUDA host function: it
 * calls no CUDA and needs no Python (the GIL is not taken); the counters (pairs, distinct blobs,
 * calls, nanoseconds of work) are what a captured step's telemetry reads. */
typedef struct {
    int64_t tokens, top_k;
    const int64_t *count;
    const int64_t *pair;
    const int64_t *blob;
    const float *weight;
    const float *x;
    float *out;
    int64_t gate_up[7], down[7];
    int64_t gate_up_bias, down_bias;
    const float *lut;
    int act;
    float alpha, limit;
    int64_t rows_per_task;
    int threads;
    int status;
    int64_t pairs, blobs, calls, nanos;
} MtHostCall;

void mt_host_pairs(void *data) {
    MtHostCall *c = (MtHostCall *)data;
    const double began = omp_get_wtime();
    const int64_t hidden = c->gate_up[5], slots = c->tokens * c->top_k;
    int64_t n = *c->count;
    n = n < 0 ? 0 : (n > slots ? slots : n);
    memset(c->out, 0, sizeof(float) * slots * hidden);
    c->calls++;
    c->status = 0;
    if (n == 0) return;
    int64_t *order = malloc(sizeof(int64_t) * n);
    int64_t *blobs = malloc(sizeof(int64_t) * n);
    int64_t *start = malloc(sizeof(int64_t) * (n + 1));
    int64_t *token = malloc(sizeof(int64_t) * n);
    float *weight = malloc(sizeof(float) * n);
    float *rows = malloc(sizeof(float) * n * hidden);
    if (!order || !blobs || !start || !token || !weight || !rows) {
        c->status = -1;
    } else {
        /* by blob address, then pair (insertion sort: at most tokens * top_k entries, and no
         * static state, so calls on several threads do not meet) */
        for (int64_t q = 0; q < n; q++) {
            int64_t p = q;
            while (p > 0 && (c->blob[order[p - 1]] > c->blob[q] ||
                             (c->blob[order[p - 1]] == c->blob[q] && order[p - 1] > q))) {
                order[p] = order[p - 1];
                p--;
            }
            order[p] = q;
        }
        int64_t n_blobs = 0;
        for (int64_t q = 0; q < n; q++) {
            const int64_t p = order[q];
            if (q == 0 || c->blob[p] != c->blob[order[q - 1]]) {
                blobs[n_blobs] = c->blob[p];
                start[n_blobs++] = q;
            }
            token[q] = c->pair[p] / c->top_k;
            weight[q] = c->weight[p];
        }
        start[n_blobs] = n;
        c->status = mt_q2s_experts(n_blobs, blobs, start, token, weight, c->tokens, c->x,
                                   c->gate_up, c->down, c->gate_up_bias, c->down_bias, c->lut,
                                   c->act, c->alpha, c->limit, c->rows_per_task, c->threads, rows);
        if (c->status == 0) {
            for (int64_t q = 0; q < n; q++)
                memcpy(c->out + c->pair[order[q]] * hidden, rows + q * hidden,
                       sizeof(float) * hidden);
            c->pairs += n;
            c->blobs += n_blobs;
        }
    }
    free(order);
    free(blobs);
    free(start);
    free(token);
    free(weight);
    free(rows);
    c->nanos += (int64_t)((omp_get_wtime() - began) * 1e9);
}

/* DRAM read: every thread sums its share of n 8-byte words; returns the sum (so the reads are
 * not optimised away). */
int64_t mt_read_sum(const int64_t *words, int64_t n, int threads) {
    int64_t total = 0;
#pragma omp parallel for schedule(static) reduction(+ : total) num_threads(threads)
    for (int64_t i = 0; i < n; i++) total += words[i];
    return total;
}
