/* Decoding's kernels on CPU: one-query and grouped attention, the cache's writes, the search's
 * log-probabilities and its top-k, the int8 products (nmt/backends/kernel_build.py compiles this
 * file; kernels.py calls each exported function through the prototype it reads here, so a prototype
 * is the one place that says what a kernel takes).
 *
 * torch's attention kernel spends most of a decoding step's attention time on per-(row, head)
 * overhead for products of one query with a few dozen keys, and beam search copies the whole
 * self-attention cache every step to follow the surviving beams. Here the cache is never moved:
 * `history` says, per position, which slot of the cache holds a row's ancestor there, and the
 * loops stream through each position's block of the cache once.
 *
 * Every tensor is contiguous, its floats float32 (the self-attention cache float32 or bf16);
 * attention's scale is 1/sqrt(head_dim), as torch's default.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

/* A pointer parameter that may be NULL (kernels.py lets None through for these only). */
#define NULLABLE

/* exp(x), vectorizable (libm's expf is not without -ffast-math): 2^n * p(r) with x = n ln2 + r,
 * |r| <= ln2/2, Cephes' polynomial; within 1e-7 relative; 0 below -87.3, exp(-inf) included. */
static inline float exp_fast(float x) {
    const float too_small = -87.3f;
    const float clamped = x < too_small ? too_small : (x > 88.3f ? 88.3f : x);
    const float n = floorf(clamped * 1.44269504088896341f + 0.5f);
    float r = fmaf(-n, 0.693359375f, clamped);  /* fmaf: the two-part ln2 must not be merged */
    r = fmaf(n, 2.12194440e-4f, r);
    float p = 1.9875691500e-4f;
    p = fmaf(p, r, 1.3981999507e-3f);
    p = fmaf(p, r, 8.3334519073e-3f);
    p = fmaf(p, r, 4.1665795894e-2f);
    p = fmaf(p, r, 1.6666665459e-1f);
    p = fmaf(p, r, 5.0000001201e-1f);
    p = fmaf(p, r * r, r) + 1.0f;
    const int32_t bits = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return x < too_small ? 0.f : p * scale;
}

static inline float dot(const float *a, const float *b, int64_t n) {
    float sum = 0.f;
    for (int64_t i = 0; i < n; ++i) sum += a[i] * b[i];
    return sum;
}

/* In place: weights[i] = exp(weights[i] - max) / sum, over the n entries that are allowed. */
static void softmax(float *weights, const uint8_t *allowed, int64_t n) {
    float max = -FLT_MAX, sum = 0.f;
    for (int64_t i = 0; i < n; ++i)
        if ((!allowed || allowed[i]) && weights[i] > max) max = weights[i];
    for (int64_t i = 0; i < n; ++i) {
        weights[i] = (!allowed || allowed[i]) ? exp_fast(weights[i] - max) : 0.f;
        sum += weights[i];
    }
    const float inverse = 1.f / sum;
    for (int64_t i = 0; i < n; ++i) weights[i] *= inverse;
}

/* bf16, as a bf16 self-attention cache stores keys and values: the upper half of a float32's bits
 * (rounded to nearest even on the way in), widened back by a shift. */
static inline uint16_t to_bf16(float x) {
    uint32_t bits;
    memcpy(&bits, &x, sizeof bits);
    if ((bits & 0x7FFFFFFFu) > 0x7F800000u) return (uint16_t)((bits >> 16) | 0x40u);  /* NaN stays NaN */
    bits += 0x7FFFu + ((bits >> 16) & 1u);
    return (uint16_t)(bits >> 16);
}

static inline float from_bf16(uint16_t x) {
    const uint32_t bits = (uint32_t)x << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* Element i of a cache of float32 or (bf16 != 0) bf16 entries. */
static inline __attribute__((always_inline)) float cached(const void *cache, int64_t i, int bf16) {
    return bf16 ? from_bf16(((const uint16_t *)cache)[i]) : ((const float *)cache)[i];
}

/* Writes rows 0..rows-1 of a new position into slots start..start+rows-1 of the cache (slots, 2,
 * width): keys and values (rows, width). */
void append_position(float *cache, int64_t start, int64_t rows, int64_t width, const float *keys,
                     const float *values) {
    float *block = cache + start * 2 * width;
    for (int64_t r = 0; r < rows; ++r) {
        memcpy(block + 2 * r * width, keys + r * width, sizeof(float) * width);
        memcpy(block + (2 * r + 1) * width, values + r * width, sizeof(float) * width);
    }
}

void append_position_bf16(uint16_t *cache, int64_t start, int64_t rows, int64_t width, const float *keys,
                          const float *values) {
    uint16_t *block = cache + start * 2 * width;
    for (int64_t r = 0; r < rows; ++r)
        for (int64_t i = 0; i < width; ++i) {
            block[2 * r * width + i] = to_bf16(keys[r * width + i]);
            block[(2 * r + 1) * width + i] = to_bf16(values[r * width + i]);
        }
}

/* Self-attention of one new query per row over `length` cached positions.
 * cache: (slots, 2, heads, head_dim), keys then values, float32 or (bf16) bf16; position p's block
 * starts at slot starts[p]; history: (length, rows) int32, the slot of row r's ancestor within each
 * position's block; query, out: (rows, heads, head_dim); scores: room for rows * heads * length floats.
 * Inlined into each caller with constant head_dim and bf16, which the compiler specializes. */
static inline __attribute__((always_inline)) void self_attention_of(
        const void *cache, int bf16, const int64_t *starts, const int32_t *history, int64_t length, int64_t rows,
        int64_t heads, int64_t head_dim, const float *query, float *out, float *scores) {
    const int64_t slot_size = 2 * heads * head_dim;
    const float scale = 1.f / sqrtf((float)head_dim);
    for (int64_t p = 0; p < length; ++p) {
        const int64_t block = starts[p] * slot_size;
        for (int64_t r = 0; r < rows; ++r) {
            const int64_t keys = block + history[p * rows + r] * slot_size;
            const float *q = query + r * heads * head_dim;
            float *s = scores + r * heads * length + p;
            int64_t h = 0;
            for (; h + 4 <= heads; h += 4) {  /* four heads' sums at once: four independent chains */
                const float *q0 = q + h * head_dim;
                const int64_t k0 = keys + h * head_dim;
                float s0 = 0.f, s1 = 0.f, s2 = 0.f, s3 = 0.f;
                for (int64_t d = 0; d < head_dim; ++d) {
                    s0 += q0[d] * cached(cache, k0 + d, bf16);
                    s1 += q0[head_dim + d] * cached(cache, k0 + head_dim + d, bf16);
                    s2 += q0[2 * head_dim + d] * cached(cache, k0 + 2 * head_dim + d, bf16);
                    s3 += q0[3 * head_dim + d] * cached(cache, k0 + 3 * head_dim + d, bf16);
                }
                s[h * length] = scale * s0;
                s[(h + 1) * length] = scale * s1;
                s[(h + 2) * length] = scale * s2;
                s[(h + 3) * length] = scale * s3;
            }
            for (; h < heads; ++h) {
                float sum = 0.f;
                for (int64_t d = 0; d < head_dim; ++d) sum += q[h * head_dim + d] * cached(cache, keys + h * head_dim + d, bf16);
                s[h * length] = scale * sum;
            }
        }
    }
    for (int64_t i = 0; i < rows * heads; ++i) softmax(scores + i * length, NULL, length);
    memset(out, 0, sizeof(float) * rows * heads * head_dim);
    for (int64_t p = 0; p < length; ++p) {
        const int64_t block = starts[p] * slot_size + heads * head_dim;
        for (int64_t r = 0; r < rows; ++r) {
            const int64_t values = block + history[p * rows + r] * slot_size;
            for (int64_t h = 0; h < heads; ++h) {
                const float weight = scores[(r * heads + h) * length + p];
                const int64_t value = values + h * head_dim;
                float *o = out + (r * heads + h) * head_dim;
                for (int64_t d = 0; d < head_dim; ++d) o[d] += weight * cached(cache, value + d, bf16);
            }
        }
    }
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define ATTENTION_AVX512 1
/* AVX-512 versions of the two attention kernels for the usual head size, 64 (the models' 512/8,
 * 256/4 and 1024/16): 16 lanes at a time where the loops above leave the compiler a horizontal sum
 * per (row, head, position) and a softmax too short to vectorize: in a decoding run's own calls,
 * 1.3x (self-attention, much of whose time is reading the cache) and 1.5x (grouped) the loops
 * above (docs/performance.md, "Attention 16 positions at a time"). */
#include <immintrin.h>

/* Lane i of the result: the sum of v[i]'s 16 lanes. */
static inline __m512 sum_lanes16_ps(const __m512 v[16]) {
    __m512 pairs[8], quads[4], halves[2];
    for (int i = 0; i < 8; ++i)
        pairs[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; ++i) {
        const __m512d a = _mm512_castps_pd(pairs[2 * i]), b = _mm512_castps_pd(pairs[2 * i + 1]);
        quads[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
    }
    for (int i = 0; i < 2; ++i)
        halves[i] = _mm512_add_ps(_mm512_shuffle_f32x4(quads[2 * i], quads[2 * i + 1], 0x88),
                                  _mm512_shuffle_f32x4(quads[2 * i], quads[2 * i + 1], 0xDD));
    return _mm512_add_ps(_mm512_shuffle_f32x4(halves[0], halves[1], 0x88),
                         _mm512_shuffle_f32x4(halves[0], halves[1], 0xDD));
}

/* exp_fast on 16 lanes, by the same operations; NaN stays NaN. */
static inline __m512 exp16(__m512 x) {
    const __m512 too_small = _mm512_set1_ps(-87.3f);
    const __m512 clamped = _mm512_min_ps(_mm512_max_ps(x, too_small), _mm512_set1_ps(88.3f));
    const __m512 n = _mm512_roundscale_ps(_mm512_fmadd_ps(clamped, _mm512_set1_ps(1.44269504088896341f),
                                                          _mm512_set1_ps(0.5f)), _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), clamped);
    r = _mm512_fmadd_ps(n, _mm512_set1_ps(2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_add_ps(_mm512_fmadd_ps(p, _mm512_mul_ps(r, r), r), _mm512_set1_ps(1.0f));
    const __m512i scale = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvttps_epi32(n), _mm512_set1_epi32(127)), 23);
    const __m512 value = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, too_small, _CMP_GE_OQ),
                                             _mm512_mul_ps(p, _mm512_castsi512_ps(scale)));
    return _mm512_mask_mov_ps(value, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), x);
}

static inline __mmask16 first_lanes(int64_t n) {
    return n >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << n) - 1);
}

/* The lanes of entries i..i+15 (of n) that are allowed (allowed NULL: all). */
static inline __mmask16 allowed_lanes(const uint8_t *allowed, int64_t i, int64_t n) {
    const __mmask16 lanes = first_lanes(n - i);
    if (!allowed) return lanes;
    return _mm512_mask_test_epi32_mask(lanes, _mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(lanes, allowed + i)),
                                       _mm512_set1_epi32(0xFF));
}

/* softmax, 16 entries at a time. */
static void softmax16(float *weights, const uint8_t *allowed, int64_t n) {
    __m512 max = _mm512_set1_ps(-FLT_MAX), sum = _mm512_setzero_ps();
    for (int64_t i = 0; i < n; i += 16) {
        const __mmask16 lanes = allowed_lanes(allowed, i, n);
        max = _mm512_mask_max_ps(max, lanes, max, _mm512_maskz_loadu_ps(lanes, weights + i));
    }
    const __m512 top = _mm512_set1_ps(_mm512_reduce_max_ps(max));
    for (int64_t i = 0; i < n; i += 16) {
        const __mmask16 all = first_lanes(n - i), lanes = allowed_lanes(allowed, i, n);
        const __m512 e = _mm512_maskz_mov_ps(lanes, exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(lanes, weights + i), top)));
        sum = _mm512_add_ps(sum, e);
        _mm512_mask_storeu_ps(weights + i, all, e);
    }
    const __m512 inverse = _mm512_set1_ps(1.f / _mm512_reduce_add_ps(sum));
    for (int64_t i = 0; i < n; i += 16) {
        const __mmask16 all = first_lanes(n - i);
        _mm512_mask_storeu_ps(weights + i, all, _mm512_mul_ps(_mm512_maskz_loadu_ps(all, weights + i), inverse));
    }
}

/* 64 entries from element i of a float32 or (bf16) bf16 array as four float vectors: float32 in
 * order; bf16 widened by a shift or a mask, each 32-entry half as its even entries, then its odd ones
 * (the queries are put in that order too, and the outputs back from it). */
static inline __attribute__((always_inline)) void load64(const void *base, int64_t i, int bf16, __m512 v[4]) {
    if (bf16) {
        const uint16_t *p = (const uint16_t *)base + i;
        const __m512i a = _mm512_loadu_si512(p), b = _mm512_loadu_si512(p + 32), high = _mm512_set1_epi32((int)0xFFFF0000u);
        v[0] = _mm512_castsi512_ps(_mm512_slli_epi32(a, 16));
        v[1] = _mm512_castsi512_ps(_mm512_and_si512(a, high));
        v[2] = _mm512_castsi512_ps(_mm512_slli_epi32(b, 16));
        v[3] = _mm512_castsi512_ps(_mm512_and_si512(b, high));
    } else {
        for (int c = 0; c < 4; ++c) v[c] = _mm512_loadu_ps((const float *)base + i + 16 * c);
    }
}

/* Each pair of vectors (v[0], v[1]) and (v[2], v[3]), as 32 entries, permuted: lane i of the first
 * takes entry first[i], of the second entry second[i]. */
static inline void permute_pairs(__m512 v[4], __m512i first, __m512i second) {
    for (int c = 0; c < 4; c += 2) {
        const __m512 a = v[c], b = v[c + 1];
        v[c] = _mm512_permutex2var_ps(a, first, b);
        v[c + 1] = _mm512_permutex2var_ps(a, second, b);
    }
}

/* Four vectors of 16 to the order load64 gives bf16 (even entries of each 32, then odd), or back. */
static inline void to_even_odd(__m512 v[4]) {
    permute_pairs(v, _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30),
                  _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31));
}

static inline void from_even_odd(__m512 v[4]) {
    permute_pairs(v, _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23),
                  _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31));
}

/* q . (the 64 entries of v), 16 partial sums. */
static inline __m512 dot64(const __m512 q[4], const __m512 v[4]) {
    return _mm512_fmadd_ps(q[3], v[3], _mm512_fmadd_ps(q[2], v[2], _mm512_fmadd_ps(q[1], v[1], _mm512_mul_ps(q[0], v[0]))));
}

/* self_attention_of for head_dim 64, a (row, head) at a time: 16 positions' sums at once. */
static inline __attribute__((always_inline)) void self_attention64(
        const void *cache, int bf16, const int64_t *starts, const int32_t *history, int64_t length, int64_t rows,
        int64_t heads, const float *query, float *out, float *scores) {
    const int64_t slot_size = 2 * heads * 64;
    const __m512 scale = _mm512_set1_ps(0.125f);  /* 1/sqrt(64) */
    for (int64_t r = 0; r < rows; ++r)
        for (int64_t h = 0; h < heads; ++h) {
            __m512 q[4], o[4], v[4], sums[16];
            load64(query, (r * heads + h) * 64, 0, q);
            if (bf16) to_even_odd(q);
            float *s = scores + (r * heads + h) * length;
            for (int64_t p0 = 0; p0 < length; p0 += 16) {
                for (int64_t j = 0; j < 16; ++j) {
                    if (p0 + j >= length) { sums[j] = _mm512_setzero_ps(); continue; }
                    load64(cache, (starts[p0 + j] + history[(p0 + j) * rows + r]) * slot_size + h * 64, bf16, v);
                    sums[j] = dot64(q, v);
                }
                _mm512_mask_storeu_ps(s + p0, first_lanes(length - p0), _mm512_mul_ps(sum_lanes16_ps(sums), scale));
            }
            softmax16(s, NULL, length);
            for (int c = 0; c < 4; ++c) o[c] = _mm512_setzero_ps();
            for (int64_t p = 0; p < length; ++p) {
                load64(cache, (starts[p] + history[p * rows + r]) * slot_size + (heads + h) * 64, bf16, v);
                const __m512 weight = _mm512_set1_ps(s[p]);
                for (int c = 0; c < 4; ++c) o[c] = _mm512_fmadd_ps(weight, v[c], o[c]);
            }
            if (bf16) from_even_odd(o);
            for (int c = 0; c < 4; ++c) _mm512_storeu_ps(out + (r * heads + h) * 64 + 16 * c, o[c]);
        }
}

/* grouped_attention_of for head_dim 64: 16 positions' sums at once. */
static void grouped_attention64(const float *keys, const float *values, const uint8_t *allowed, const int64_t *rows,
                                int64_t sentences, int64_t group, int64_t heads, int64_t length, const float *query,
                                float *out, float *scores) {
    const __m512 scale = _mm512_set1_ps(0.125f);  /* 1/sqrt(64) */
    for (int64_t s = 0; s < sentences; ++s) {
        const int64_t stored = rows ? rows[s] : s;
        const uint8_t *mask = allowed + s * length;
        for (int64_t h = 0; h < heads; ++h) {
            const float *k = keys + (stored * heads + h) * length * 64;
            const float *v = values + (stored * heads + h) * length * 64;
            for (int64_t g = 0; g < group; ++g) {
                const int64_t at = ((s * group + g) * heads + h) * 64;
                __m512 q[4], o[4], kv[4], sums[16];
                load64(query, at, 0, q);
                for (int64_t p0 = 0; p0 < length; p0 += 16) {
                    for (int64_t j = 0; j < 16; ++j) {
                        if (p0 + j >= length) { sums[j] = _mm512_setzero_ps(); continue; }
                        load64(k, (p0 + j) * 64, 0, kv);
                        sums[j] = dot64(q, kv);
                    }
                    _mm512_mask_storeu_ps(scores + p0, first_lanes(length - p0), _mm512_mul_ps(sum_lanes16_ps(sums), scale));
                }
                softmax16(scores, mask, length);  /* padding's weights are 0 */
                for (int c = 0; c < 4; ++c) o[c] = _mm512_setzero_ps();
                for (int64_t p = 0; p < length; ++p) {
                    if (!mask[p]) continue;
                    const __m512 weight = _mm512_set1_ps(scores[p]);
                    load64(v, p * 64, 0, kv);
                    for (int c = 0; c < 4; ++c) o[c] = _mm512_fmadd_ps(weight, kv[c], o[c]);
                }
                for (int c = 0; c < 4; ++c) _mm512_storeu_ps(out + at + 16 * c, o[c]);
            }
        }
    }
}
#endif

/* Both caches' self-attention: head size 64 (the usual one, known to the compiler here: unrolled
 * loops without remainders) in AVX-512 where built with it, any other in the plain loops. Inlined into
 * the two kernels below, each with its constant bf16, which the compiler specializes. */
static inline __attribute__((always_inline)) void self_attention_for(
        const void *cache, int bf16, const int64_t *starts, const int32_t *history, int64_t length, int64_t rows,
        int64_t heads, int64_t head_dim, const float *query, float *out, float *scores) {
    if (head_dim == 64)
#if ATTENTION_AVX512
        self_attention64(cache, bf16, starts, history, length, rows, heads, query, out, scores);
#else
        self_attention_of(cache, bf16, starts, history, length, rows, heads, 64, query, out, scores);
#endif
    else
        self_attention_of(cache, bf16, starts, history, length, rows, heads, head_dim, query, out, scores);
}

void self_attention(const float *cache, const int64_t *starts, const int32_t *history, int64_t length, int64_t rows,
                    int64_t heads, int64_t head_dim, const float *query, float *out, float *scores) {
    self_attention_for(cache, 0, starts, history, length, rows, heads, head_dim, query, out, scores);
}

void self_attention_bf16(const uint16_t *cache, const int64_t *starts, const int32_t *history, int64_t length,
                         int64_t rows, int64_t heads, int64_t head_dim, const float *query, float *out,
                         float *scores) {
    self_attention_for(cache, 1, starts, history, length, rows, heads, head_dim, query, out, scores);
}

/* Attention of `group` queries per sentence (its beams) to that sentence's keys and values.
 * keys, values: (stored, heads, length, head_dim); allowed: (sentences, length), 0 at padding;
 * query, out: (sentences, group, heads, head_dim); sentence s reads stored row rows[s] (rows NULL:
 * row s); scores: room for length floats. */
static inline void grouped_attention_of(const float *keys, const float *values, const uint8_t *allowed,
                                        const int64_t *rows, int64_t sentences, int64_t group, int64_t heads,
                                        int64_t length, int64_t head_dim, const float *query, float *out,
                                        float *scores) {
    const float scale = 1.f / sqrtf((float)head_dim);
    for (int64_t s = 0; s < sentences; ++s) {
        const int64_t stored = rows ? rows[s] : s;
        const uint8_t *mask = allowed + s * length;
        /* Up to the sentence's last allowed position: its padding after that, which depends on the
         * batch, must not move positions between the loops below nor change the length of the
         * softmax's sum (an int8 model's rounding turned such last-bit differences into other scores). */
        int64_t used = length;
        while (used > 0 && !mask[used - 1]) --used;
        for (int64_t h = 0; h < heads; ++h) {
            const float *k = keys + (stored * heads + h) * length * head_dim;
            const float *v = values + (stored * heads + h) * length * head_dim;
            for (int64_t g = 0; g < group; ++g) {
                const int64_t at = ((s * group + g) * heads + h) * head_dim;
                const float *q = query + at;
                int64_t p = 0;
                for (; p + 4 <= used; p += 4) {  /* four positions' sums at once */
                    const float *k0 = k + p * head_dim;
                    float s0 = 0.f, s1 = 0.f, s2 = 0.f, s3 = 0.f;
                    for (int64_t d = 0; d < head_dim; ++d) {
                        s0 += q[d] * k0[d];
                        s1 += q[d] * k0[head_dim + d];
                        s2 += q[d] * k0[2 * head_dim + d];
                        s3 += q[d] * k0[3 * head_dim + d];
                    }
                    scores[p] = scale * s0;
                    scores[p + 1] = scale * s1;
                    scores[p + 2] = scale * s2;
                    scores[p + 3] = scale * s3;
                }
                for (; p < used; ++p) scores[p] = scale * dot(q, k + p * head_dim, head_dim);
                softmax(scores, mask, used);  /* padding's weights are 0 */
                float *o = out + at;
                memset(o, 0, sizeof(float) * head_dim);
                for (p = 0; p < used; ++p) {
                    if (!mask[p]) continue;
                    const float weight = scores[p];
                    for (int64_t d = 0; d < head_dim; ++d) o[d] += weight * v[p * head_dim + d];
                }
            }
        }
    }
}

void grouped_attention(const float *keys, const float *values, const uint8_t *allowed,
                       const int64_t *NULLABLE rows, int64_t sentences, int64_t group, int64_t heads, int64_t length,
                       int64_t head_dim, const float *query, float *out, float *scores) {
    if (head_dim == 64)
#if ATTENTION_AVX512
        grouped_attention64(keys, values, allowed, rows, sentences, group, heads, length, query, out, scores);
#else
        grouped_attention_of(keys, values, allowed, rows, sentences, group, heads, length, 64, query, out, scores);
#endif
    else
        grouped_attention_of(keys, values, allowed, rows, sentences, group, heads, length, head_dim, query, out,
                             scores);
}

/* In place, row by row: logits (rows, columns) become log-probabilities over the columns a row may
 * choose. Rows come `width` per sentence, sentence i being row which[i] of banned (sentences,
 * columns): 0 where the sentence may choose a column and -inf where not; banned NULL: every column.
 * One pass over a row in cache where torch makes three over the whole matrix (add the ban,
 * log_softmax's max and sums, its write). */
void log_softmax_rows(float *logits, int64_t rows, int64_t columns, const float *NULLABLE banned,
                      const int64_t *NULLABLE which, int64_t width) {
    for (int64_t r = 0; r < rows; ++r) {
        float *x = logits + r * columns;
        if (banned) {
            const float *ban = banned + which[r / width] * columns;
            for (int64_t c = 0; c < columns; ++c) x[c] += ban[c];
        }
        /* Up to the row's last column that is not -inf: the -inf columns after it (a shortlist narrower
         * than its batch's widest) must not change the length of the vectorized sum, whose order
         * would then differ in the last bits from the sentence's alone. */
        int64_t used = columns;
        while (used > 1 && x[used - 1] == -INFINITY) --used;
        float max = -INFINITY, sum = 0.f;
        for (int64_t c = 0; c < used; ++c) max = x[c] > max ? x[c] : max;
        for (int64_t c = 0; c < used; ++c) sum += exp_fast(x[c] - max);
        const float log_sum = max + logf(sum);
        for (int64_t c = 0; c < columns; ++c) x[c] -= log_sum;
    }
}

/* Beam search's choice: per sentence, the `count` best continuations score + logprob over its `width`
 * rows of logprobs (rows, columns), best first: out_scores, out_rows (row within the sentence) and
 * out_columns (sentences, count). A block of 64 columns is looked into only when its maximum could
 * enter the best so far. Fewer than `count` columns in all: the rest are -inf, row 0, column 0. A NaN
 * counts as -inf. */
void select_top(const float *logprobs, const float *scores, int64_t sentences, int64_t width, int64_t columns,
                int64_t count, float *out_scores, int64_t *out_rows, int64_t *out_columns) {
    const int64_t block = 64;
    for (int64_t s = 0; s < sentences; ++s) {
        float *best = out_scores + s * count;
        int64_t *rows = out_rows + s * count, *cols = out_columns + s * count;
        int64_t kept = 0;
        for (int64_t w = 0; w < width; ++w) {
            const float score = scores[s * width + w];
            const float *x = logprobs + (s * width + w) * columns;
            for (int64_t start = 0; start < columns; start += block) {
                const int64_t end = start + block < columns ? start + block : columns;
                float max = -INFINITY;
                for (int64_t c = start; c < end; ++c) max = x[c] > max ? x[c] : max;
                if (kept == count && !(score + max > best[count - 1])) continue;
                for (int64_t c = start; c < end; ++c) {
                    float value = score + x[c];
                    if (value != value) value = -INFINITY;  /* NaN: a dead candidate, never one in the way */
                    if (kept == count && !(value > best[count - 1])) continue;
                    int64_t i = kept < count ? kept++ : count - 1;  /* insertion into the sorted list */
                    for (; i > 0 && value > best[i - 1]; --i) {
                        best[i] = best[i - 1]; rows[i] = rows[i - 1]; cols[i] = cols[i - 1];
                    }
                    best[i] = value; rows[i] = w; cols[i] = c;
                }
            }
        }
        for (; kept < count; ++kept) {
            best[kept] = -INFINITY; rows[kept] = 0; cols[kept] = 0;
        }
    }
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define INT8_VNNI 1
#else
#define INT8_VNNI 0
#endif

/* x (dim) as q + offset, q = round(x * 127 / max |x|) in -127..127 (to nearest even), in quantized
 * (k_pad bytes, the padding `offset`: a q of 0); its scale max / 127 in *scale, NaN for a row with an
 * inf or a NaN (whose outputs are then NaN). The maximum is taken over the floats' bits (for |x| the
 * integers' order, inf and NaN above every finite float): loops that compilers vectorize. */
static void quantize_row(const float *x, int64_t dim, int64_t k_pad, int offset, uint8_t *quantized, float *scale) {
    uint32_t top = 0;
    for (int64_t k = 0; k < dim; ++k) {
        uint32_t bits;
        memcpy(&bits, x + k, sizeof bits);
        bits &= 0x7FFFFFFFu;
        top = bits > top ? bits : top;
    }
    memset(quantized + dim, offset, k_pad - dim);
    if (top > 0x7F7FFFFFu) {
        memset(quantized, offset, dim);
        *scale = NAN;
        return;
    }
    float max;
    memcpy(&max, &top, sizeof max);
    const float inverse = max > 0.f ? fminf(127.f / max, FLT_MAX) : 0.f;  /* a tiny max: no inf */
    for (int64_t k = 0; k < dim; ++k) quantized[k] = (uint8_t)((int32_t)nearbyintf(x[k] * inverse) + offset);
    *scale = max / 127.f;
}

/* The int8 output projection onto each sentence's own vocabulary entries (its shortlist candidates):
 * out (sentences * group, width) for x (sentences * group, dim), the `group` rows of a sentence
 * consecutive; column j of sentence s is weight row columns[s][j] for j < counts[s], -inf after.
 * Each row of x is quantized with a scale of its own (max |x| / 127, a row of a sentence never
 * depends on the batch's other rows), held as q + 128 in `quantized` (rows, dim rounded up to 64)
 * for VNNI's unsigned-by-signed products; column_sums (sentences, width) are the weight rows' sums,
 * which take the +128 back out, and column_scales (sentences, width) their scales. weight
 * (vocabulary, dim) int8, a scale per row. With AVX512-VNNI: 16
 * columns at a time, 64 products per instruction, their lanes summed at the end; else plain loops.
 * A row with an infinite or NaN entry gets NaN logits. */
#if INT8_VNNI
#include <immintrin.h>

/* Lane i of the result: the sum of v[i]'s 16 lanes. */
static inline __m512i sum_lanes16(const __m512i v[16]) {
    __m512i pairs[8], quads[4], halves[2];
    for (int i = 0; i < 8; ++i)
        pairs[i] = _mm512_add_epi32(_mm512_unpacklo_epi32(v[2 * i], v[2 * i + 1]),
                                    _mm512_unpackhi_epi32(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; ++i)
        quads[i] = _mm512_add_epi32(_mm512_unpacklo_epi64(pairs[2 * i], pairs[2 * i + 1]),
                                    _mm512_unpackhi_epi64(pairs[2 * i], pairs[2 * i + 1]));
    for (int i = 0; i < 2; ++i)
        halves[i] = _mm512_add_epi32(_mm512_shuffle_i32x4(quads[2 * i], quads[2 * i + 1], 0x88),
                                     _mm512_shuffle_i32x4(quads[2 * i], quads[2 * i + 1], 0xDD));
    return _mm512_add_epi32(_mm512_shuffle_i32x4(halves[0], halves[1], 0x88),
                            _mm512_shuffle_i32x4(halves[0], halves[1], 0xDD));
}

static void project_row(const uint8_t *q, int64_t dim, const int8_t *weight, const int64_t *columns,
                        const int32_t *sums, const float *scales, int64_t count, float row_scale, float *out) {
    const int64_t chunks = (dim + 63) / 64;
    const __mmask64 tail = dim % 64 ? (((__mmask64)1 << (dim % 64)) - 1) : ~(__mmask64)0;
    for (int64_t j0 = 0; j0 < count; j0 += 16) {
        const int64_t n = count - j0 < 16 ? count - j0 : 16;
        const int8_t *w[16];
        for (int t = 0; t < 16; ++t) w[t] = weight + columns[j0 + (t < n ? t : 0)] * dim;
        __m512i acc[16];
        for (int t = 0; t < 16; ++t) acc[t] = _mm512_setzero_si512();
        for (int64_t c = 0; c < chunks - 1; ++c) {
            const __m512i a = _mm512_loadu_si512(q + 64 * c);
            for (int t = 0; t < 16; ++t) acc[t] = _mm512_dpbusd_epi32(acc[t], a, _mm512_loadu_si512(w[t] + 64 * c));
        }
        const int64_t c = chunks - 1;
        const __m512i a = _mm512_loadu_si512(q + 64 * c);
        for (int t = 0; t < 16; ++t)
            acc[t] = _mm512_dpbusd_epi32(acc[t], a, _mm512_maskz_loadu_epi8(tail, w[t] + 64 * c));
        const __mmask16 kept = (__mmask16)((1u << n) - 1);
        const __m512i offset = _mm512_slli_epi32(_mm512_maskz_loadu_epi32(kept, sums + j0), 7);  /* 128 * sum */
        const __m512 scale = _mm512_mul_ps(_mm512_set1_ps(row_scale), _mm512_maskz_loadu_ps(kept, scales + j0));
        const __m512 value = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(sum_lanes16(acc), offset)), scale,
                                             _mm512_setzero_ps());  /* the plain loop's rounding: no reassociation */
        _mm512_mask_storeu_ps(out + j0, kept, value);
    }
}
#else
static void project_row(const uint8_t *q, int64_t dim, const int8_t *weight, const int64_t *columns,
                        const int32_t *sums, const float *scales, int64_t count, float row_scale, float *out) {
    for (int64_t j = 0; j < count; ++j) {
        const int8_t *w = weight + columns[j] * dim;
        int32_t acc = 0;
        for (int64_t k = 0; k < dim; ++k) acc += (int32_t)q[k] * (int32_t)w[k];
        out[j] = fmaf((float)(acc - 128 * sums[j]), row_scale * scales[j], 0.f);
    }
}
#endif

int attention_avx512(void) {
#if ATTENTION_AVX512
    return 1;
#else
    return 0;
#endif
}

/* Whether the int8 kernels (project_columns_int8, int8_linear) run VNNI's instructions. */
int int8_vnni(void) { return INT8_VNNI; }

/* quantized: room for one row, dim rounded up to 64. The int32 sums hold for dim < 66,000. */
void project_columns_int8(const float *x, int64_t sentences, int64_t group, int64_t dim, const int8_t *weight,
                          const int64_t *columns, const int32_t *column_sums, const float *column_scales,
                          const int32_t *counts, int64_t width, float *out, uint8_t *quantized) {
    const int64_t stride = (dim + 63) / 64 * 64;
    for (int64_t r = 0; r < sentences * group; ++r) {
        const int64_t s = r / group;
        float *o = out + r * width;
        float row_scale;
        quantize_row(x + r * dim, dim, stride, 128, quantized, &row_scale);
        if (isnan(row_scale)) {  /* an inf or NaN: no logits to be had */
            for (int64_t j = 0; j < width; ++j) o[j] = j < counts[s] ? NAN : -INFINITY;
            continue;
        }
        project_row(quantized, dim, weight, columns + s * width, column_sums + s * width,
                    column_scales + s * width, counts[s], row_scale, o);
        for (int64_t j = counts[s]; j < width; ++j) o[j] = -INFINITY;
    }
}

/* Dense int8 products (nmt/backends/int8.py's Int8Linear): out (rows, out_features) = x (rows, in_features)
 * times an int8 weight (its rows: the outputs), each row of x quantized with a scale of its own
 * (max |x| / 127, as above), so that a row's outputs never depend on the batch's other rows. The
 * integer sums are exact in any order, and each output is then sum * (row scale * output's scale)
 * + bias in one rounding (fmaf), the ReLU after where asked: the same bits whichever path computes
 * them, int8_linear's VNNI tiles, its plain loops, or torch's int8 product between
 * int8_quantize_rows and int8_scale_outputs (int8.py says where).
 *
 * For int8_linear the weight is packed once per layer (pack_int8_weight): panels of 64 outputs (the
 * last 16, 32 or 48: outputs rounded up to 16 with zero rows), each panel in groups of 4 inputs
 * (inputs rounded up to 4 with zeros), a group holding the panel's outputs' 4 weights side by side:
 * one 64-byte load gives 16 outputs' 4 weights, which vpdpbusd multiplies by one row's 4 inputs
 * (broadcast, held as q + 128) in one instruction. A tile is up to 6 rows by a panel, 24
 * accumulators; the weight's row sums take the 128s back out. */
#define INT8_PANEL 64
#define INT8_TILE_ROWS 6

static inline int64_t round_up(int64_t n, int64_t m) { return (n + m - 1) / m * m; }

void pack_int8_weight(const int8_t *weight, int64_t out_features, int64_t in_features, int8_t *packed) {
    const int64_t n_pad = round_up(out_features, 16), k_pad = round_up(in_features, 4);
    for (int64_t n0 = 0; n0 < n_pad; n0 += INT8_PANEL) {
        const int64_t width = n_pad - n0 < INT8_PANEL ? n_pad - n0 : INT8_PANEL;
        int8_t *panel = packed + n0 * k_pad;
        for (int64_t g = 0; g < k_pad / 4; ++g)
            for (int64_t c = 0; c < width; ++c)
                for (int64_t t = 0; t < 4; ++t) {
                    const int64_t n = n0 + c, k = 4 * g + t;
                    panel[(g * width + c) * 4 + t] = n < out_features && k < in_features ? weight[n * in_features + k] : 0;
                }
    }
}

/* One output from its integer sum (of q * w). */
static inline float int8_output(int32_t sum, float row_scale, float scale, float bias, int relu) {
    const float value = fmaf((float)sum, row_scale * scale, bias);
    return relu && value < 0.f ? 0.f : value;  /* NaN stays NaN */
}

/* The rows of x (rows, dim) as int8_linear quantizes them, but as q (int8: offset 0) or q + 128
 * (offset 128), each in `stride` bytes; their scales in row_scales. */
void int8_quantize_rows(const float *x, int64_t rows, int64_t dim, int64_t stride, int64_t offset,
                        uint8_t *quantized, float *row_scales) {
    for (int64_t r = 0; r < rows; ++r)
        quantize_row(x + r * dim, dim, stride, (int)offset, quantized + r * stride, row_scales + r);
}

/* out (rows, columns) from the integer sums (rows, columns), as int8_linear's outputs. */
void int8_scale_outputs(const int32_t *sums, int64_t rows, int64_t columns, const float *row_scales,
                        const float *scales, const float *bias, int64_t relu, float *out) {
    for (int64_t r = 0; r < rows; ++r)
        for (int64_t c = 0; c < columns; ++c)
            out[r * columns + c] = int8_output(sums[r * columns + c], row_scales[r], scales[c], bias[c], (int)relu);
}

#if INT8_VNNI
/* Row `row_scale`'s 16 outputs from acc, the sums of (q + 128) * w: int8_output's arithmetic. */
static inline __attribute__((always_inline)) void int8_store16(
        __m512i acc, float row_scale, const int32_t *weight_sums, const float *scales, const float *bias, int relu,
        float *out, __mmask16 lanes) {
    const __m512i offset = _mm512_slli_epi32(_mm512_loadu_si512(weight_sums), 7);  /* 128 * sum */
    const __m512 sum = _mm512_cvtepi32_ps(_mm512_sub_epi32(acc, offset));
    __m512 value = _mm512_fmadd_ps(sum, _mm512_mul_ps(_mm512_set1_ps(row_scale), _mm512_loadu_ps(scales)),
                                   _mm512_loadu_ps(bias));
    if (relu) value = _mm512_max_ps(_mm512_setzero_ps(), value);  /* NaN: the second operand, kept */
    _mm512_mask_storeu_ps(out, lanes, value);
}

/* The accumulators are named variables: GCC kept an array of them on the stack, 1.5x slower. */
#define INT8_ACCUMULATORS(R) __m512i acc##R##0 = _mm512_setzero_si512(), acc##R##1 = acc##R##0, \
    acc##R##2 = acc##R##0, acc##R##3 = acc##R##0;
#define INT8_ROW(R) \
    if (rows > R) { \
        int32_t four; \
        memcpy(&four, a + R * k_pad + 4 * g, sizeof four); \
        const __m512i x = _mm512_set1_epi32(four); \
        acc##R##0 = _mm512_dpbusd_epi32(acc##R##0, x, w0); \
        if (vectors > 1) acc##R##1 = _mm512_dpbusd_epi32(acc##R##1, x, w1); \
        if (vectors > 2) acc##R##2 = _mm512_dpbusd_epi32(acc##R##2, x, w2); \
        if (vectors > 3) acc##R##3 = _mm512_dpbusd_epi32(acc##R##3, x, w3); \
    }
#define INT8_STORE(R, V) \
    if (rows > R && vectors > V && columns > 16 * V) \
        int8_store16(acc##R##V, row_scales[R], weight_sums + 16 * V, scales + 16 * V, bias + 16 * V, relu, \
                     out + R * out_stride + 16 * V, \
                     columns >= 16 * (V + 1) ? (__mmask16)0xFFFF : (__mmask16)((1u << (columns - 16 * V)) - 1));
#define INT8_STORE_ROW(R) INT8_STORE(R, 0) INT8_STORE(R, 1) INT8_STORE(R, 2) INT8_STORE(R, 3)

/* rows (<= 6) of quantized inputs a by a panel of 16 * vectors (<= 4) outputs, its first `columns`
 * stored; inlined with constant rows and vectors (int8_tile_of), the code for other counts removed. */
static inline __attribute__((always_inline)) void int8_tile(
        const uint8_t *a, int64_t k_pad, int rows, const int8_t *panel, int vectors, const float *row_scales,
        const int32_t *weight_sums, const float *scales, const float *bias, int relu, float *out,
        int64_t out_stride, int64_t columns) {
    INT8_ACCUMULATORS(0) INT8_ACCUMULATORS(1) INT8_ACCUMULATORS(2) INT8_ACCUMULATORS(3) INT8_ACCUMULATORS(4)
    INT8_ACCUMULATORS(5)
    const int64_t groups = k_pad / 4, width = 16 * vectors;
    for (int64_t g = 0; g < groups; ++g) {
        const int8_t *p = panel + g * width * 4;
        const __m512i w0 = _mm512_loadu_si512(p);
        const __m512i w1 = vectors > 1 ? _mm512_loadu_si512(p + 64) : w0;
        const __m512i w2 = vectors > 2 ? _mm512_loadu_si512(p + 128) : w0;
        const __m512i w3 = vectors > 3 ? _mm512_loadu_si512(p + 192) : w0;
        INT8_ROW(0) INT8_ROW(1) INT8_ROW(2) INT8_ROW(3) INT8_ROW(4) INT8_ROW(5)
    }
    INT8_STORE_ROW(0) INT8_STORE_ROW(1) INT8_STORE_ROW(2) INT8_STORE_ROW(3) INT8_STORE_ROW(4) INT8_STORE_ROW(5)
}

#define INT8_TILE_CASE(ROWS, VECTORS) \
    case (ROWS) * 8 + (VECTORS): \
        int8_tile(a, k_pad, ROWS, panel, VECTORS, row_scales, weight_sums, scales, bias, relu, out, out_stride, \
                  columns); \
        break;
#define INT8_TILE_CASES(ROWS) INT8_TILE_CASE(ROWS, 1) INT8_TILE_CASE(ROWS, 2) INT8_TILE_CASE(ROWS, 3) \
    INT8_TILE_CASE(ROWS, 4)

static void int8_tile_of(const uint8_t *a, int64_t k_pad, int rows, const int8_t *panel, int vectors,
                         const float *row_scales, const int32_t *weight_sums, const float *scales, const float *bias,
                         int relu, float *out, int64_t out_stride, int64_t columns) {
    switch (rows * 8 + vectors) {
        INT8_TILE_CASES(1) INT8_TILE_CASES(2) INT8_TILE_CASES(3) INT8_TILE_CASES(4) INT8_TILE_CASES(5)
        INT8_TILE_CASES(6)
        default: break;
    }
}
#else
static void int8_tile_of(const uint8_t *a, int64_t k_pad, int rows, const int8_t *panel, int vectors,
                         const float *row_scales, const int32_t *weight_sums, const float *scales, const float *bias,
                         int relu, float *out, int64_t out_stride, int64_t columns) {
    const int64_t width = 16 * vectors, groups = k_pad / 4;
    for (int r = 0; r < rows; ++r) {
        int32_t acc[INT8_PANEL] = {0};
        for (int64_t g = 0; g < groups; ++g) {
            const uint8_t *x = a + r * k_pad + 4 * g;
            const int8_t *w = panel + g * width * 4;
            for (int64_t c = 0; c < width; ++c)
                acc[c] += x[0] * w[4 * c] + x[1] * w[4 * c + 1] + x[2] * w[4 * c + 2] + x[3] * w[4 * c + 3];
        }
        for (int64_t c = 0; c < width && c < columns; ++c)
            out[r * out_stride + c] = int8_output(acc[c] - 128 * weight_sums[c], row_scales[r], scales[c], bias[c],
                                                  relu);
    }
}
#endif

/* out (rows, out_features) for x (rows, in_features), the weight packed by pack_int8_weight;
 * weight_sums (its rows' sums), scales and bias with room for out_features rounded up to 16 (zeros
 * after); quantized: room for rows x in_features rounded up to 4 bytes; row_scales for rows floats.
 * The int32 sums hold for in_features < 66,000. Without VNNI: plain loops, 6-14x slower than
 * VNNI's tiles (AVX-512 without VNNI, or AVX2: measured on a Zen 4), where int8.py takes torch's
 * int8 product instead. */
void int8_linear(const float *x, int64_t rows, int64_t in_features, const int8_t *packed, int64_t out_features,
                 const int32_t *weight_sums, const float *scales, const float *bias, int64_t relu, float *out,
                 uint8_t *quantized, float *row_scales) {
    const int64_t k_pad = round_up(in_features, 4), n_pad = round_up(out_features, 16);
    int8_quantize_rows(x, rows, in_features, k_pad, 128, quantized, row_scales);
    for (int64_t n0 = 0; n0 < n_pad; n0 += INT8_PANEL) {
        const int64_t width = n_pad - n0 < INT8_PANEL ? n_pad - n0 : INT8_PANEL;
        for (int64_t r0 = 0; r0 < rows; r0 += INT8_TILE_ROWS)
            int8_tile_of(quantized + r0 * k_pad, k_pad, (int)(rows - r0 < INT8_TILE_ROWS ? rows - r0 : INT8_TILE_ROWS),
                         packed + n0 * k_pad, (int)(width / 16), row_scales + r0, weight_sums + n0, scales + n0,
                         bias + n0, (int)relu, out + r0 * out_features + n0, out_features, out_features - n0);
    }
}
