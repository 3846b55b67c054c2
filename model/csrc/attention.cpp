// Attention for short sequences on CPUs (x86-64 with AVX2 and FMA): for every (batch, head) pair
// the scores, the softmax and both products of the forward, and the five products of the backward,
// in tiles of at most 64 × 64 that stay in L1/L2, with register-blocked AVX2 products. At the
// deep-narrow shapes this project trains on CPUs (32 tokens, 2 heads of 32) torch's CPU flash
// kernel spends most of its time around its tiny matrix products (a BLAS call per tile, zeroed
// gradient buffers); see model/attention.py for the measured difference and when it is used.
//
// Layout: q [B, Tq, H·D], k and v [B, Tk, H·D] (the projections' outputs, rows contiguous, any
// row and batch strides), head h in columns [h·D, (h+1)·D). The output and the gradients come out
// in the same [B, T, H·D] layout, so no transposes are needed around the kernel. The forward keeps
// the log-sum-exp of every score row; the backward recomputes the probabilities from it (flash
// attention's recomputation), so nothing of size T × T is stored.
//
// Softmax: e^x by Cephes' expf scheme (range reduction by ln 2, degree-6 polynomial, ~1 ulp),
// masked keys at −inf give exactly 0. A row that may see no key (every key padded) gives zeros.
#include "kernels.h"

#include <cmath>
#include <limits>

#if defined(__AVX2__) && defined(__FMA__)
#include <ATen/Parallel.h>
#include <immintrin.h>

namespace {

constexpr int kMax = kShortAttentionMax;

// C[r][0:8·NV] = alpha · Σ_k A[r][k] · B[k][0:8·NV] for R rows: accumulators as named variables
// (GCC keeps an accumulator array on the stack, a store per FMA).
inline void block6x2(const float* __restrict A, int64_t lda, const float* __restrict B, int64_t ldb,
                        float* __restrict C, int64_t ldc, int kk, __m256 alpha) {
  __m256 c00 = _mm256_setzero_ps(), c01 = _mm256_setzero_ps(), c10 = _mm256_setzero_ps(), c11 = _mm256_setzero_ps(), c20 = _mm256_setzero_ps(), c21 = _mm256_setzero_ps(), c30 = _mm256_setzero_ps(), c31 = _mm256_setzero_ps(), c40 = _mm256_setzero_ps(), c41 = _mm256_setzero_ps(), c50 = _mm256_setzero_ps(), c51 = _mm256_setzero_ps();
  for (int k = 0; k < kk; ++k) {
    const __m256 b0 = _mm256_loadu_ps(B + k * ldb + 0);
    const __m256 b1 = _mm256_loadu_ps(B + k * ldb + 8);
    { const __m256 x = _mm256_broadcast_ss(A + 0 * lda + k);
      c00 = _mm256_fmadd_ps(x, b0, c00);
      c01 = _mm256_fmadd_ps(x, b1, c01);
    }
    { const __m256 x = _mm256_broadcast_ss(A + 1 * lda + k);
      c10 = _mm256_fmadd_ps(x, b0, c10);
      c11 = _mm256_fmadd_ps(x, b1, c11);
    }
    { const __m256 x = _mm256_broadcast_ss(A + 2 * lda + k);
      c20 = _mm256_fmadd_ps(x, b0, c20);
      c21 = _mm256_fmadd_ps(x, b1, c21);
    }
    { const __m256 x = _mm256_broadcast_ss(A + 3 * lda + k);
      c30 = _mm256_fmadd_ps(x, b0, c30);
      c31 = _mm256_fmadd_ps(x, b1, c31);
    }
    { const __m256 x = _mm256_broadcast_ss(A + 4 * lda + k);
      c40 = _mm256_fmadd_ps(x, b0, c40);
      c41 = _mm256_fmadd_ps(x, b1, c41);
    }
    { const __m256 x = _mm256_broadcast_ss(A + 5 * lda + k);
      c50 = _mm256_fmadd_ps(x, b0, c50);
      c51 = _mm256_fmadd_ps(x, b1, c51);
    }
  }
  _mm256_storeu_ps(C + 0 * ldc + 0, _mm256_mul_ps(alpha, c00));
  _mm256_storeu_ps(C + 0 * ldc + 8, _mm256_mul_ps(alpha, c01));
  _mm256_storeu_ps(C + 1 * ldc + 0, _mm256_mul_ps(alpha, c10));
  _mm256_storeu_ps(C + 1 * ldc + 8, _mm256_mul_ps(alpha, c11));
  _mm256_storeu_ps(C + 2 * ldc + 0, _mm256_mul_ps(alpha, c20));
  _mm256_storeu_ps(C + 2 * ldc + 8, _mm256_mul_ps(alpha, c21));
  _mm256_storeu_ps(C + 3 * ldc + 0, _mm256_mul_ps(alpha, c30));
  _mm256_storeu_ps(C + 3 * ldc + 8, _mm256_mul_ps(alpha, c31));
  _mm256_storeu_ps(C + 4 * ldc + 0, _mm256_mul_ps(alpha, c40));
  _mm256_storeu_ps(C + 4 * ldc + 8, _mm256_mul_ps(alpha, c41));
  _mm256_storeu_ps(C + 5 * ldc + 0, _mm256_mul_ps(alpha, c50));
  _mm256_storeu_ps(C + 5 * ldc + 8, _mm256_mul_ps(alpha, c51));
}

inline void block3x2(const float* __restrict A, int64_t lda, const float* __restrict B, int64_t ldb,
                        float* __restrict C, int64_t ldc, int kk, __m256 alpha) {
  __m256 c00 = _mm256_setzero_ps(), c01 = _mm256_setzero_ps(), c10 = _mm256_setzero_ps(), c11 = _mm256_setzero_ps(), c20 = _mm256_setzero_ps(), c21 = _mm256_setzero_ps();
  for (int k = 0; k < kk; ++k) {
    const __m256 b0 = _mm256_loadu_ps(B + k * ldb + 0);
    const __m256 b1 = _mm256_loadu_ps(B + k * ldb + 8);
    { const __m256 x = _mm256_broadcast_ss(A + 0 * lda + k);
      c00 = _mm256_fmadd_ps(x, b0, c00);
      c01 = _mm256_fmadd_ps(x, b1, c01);
    }
    { const __m256 x = _mm256_broadcast_ss(A + 1 * lda + k);
      c10 = _mm256_fmadd_ps(x, b0, c10);
      c11 = _mm256_fmadd_ps(x, b1, c11);
    }
    { const __m256 x = _mm256_broadcast_ss(A + 2 * lda + k);
      c20 = _mm256_fmadd_ps(x, b0, c20);
      c21 = _mm256_fmadd_ps(x, b1, c21);
    }
  }
  _mm256_storeu_ps(C + 0 * ldc + 0, _mm256_mul_ps(alpha, c00));
  _mm256_storeu_ps(C + 0 * ldc + 8, _mm256_mul_ps(alpha, c01));
  _mm256_storeu_ps(C + 1 * ldc + 0, _mm256_mul_ps(alpha, c10));
  _mm256_storeu_ps(C + 1 * ldc + 8, _mm256_mul_ps(alpha, c11));
  _mm256_storeu_ps(C + 2 * ldc + 0, _mm256_mul_ps(alpha, c20));
  _mm256_storeu_ps(C + 2 * ldc + 8, _mm256_mul_ps(alpha, c21));
}

inline void block1x2(const float* __restrict A, int64_t lda, const float* __restrict B, int64_t ldb,
                        float* __restrict C, int64_t ldc, int kk, __m256 alpha) {
  __m256 c00 = _mm256_setzero_ps(), c01 = _mm256_setzero_ps();
  for (int k = 0; k < kk; ++k) {
    const __m256 b0 = _mm256_loadu_ps(B + k * ldb + 0);
    const __m256 b1 = _mm256_loadu_ps(B + k * ldb + 8);
    { const __m256 x = _mm256_broadcast_ss(A + 0 * lda + k);
      c00 = _mm256_fmadd_ps(x, b0, c00);
      c01 = _mm256_fmadd_ps(x, b1, c01);
    }
  }
  _mm256_storeu_ps(C + 0 * ldc + 0, _mm256_mul_ps(alpha, c00));
  _mm256_storeu_ps(C + 0 * ldc + 8, _mm256_mul_ps(alpha, c01));
}

inline void block8x1(const float* __restrict A, int64_t lda, const float* __restrict B, int64_t ldb,
                        float* __restrict C, int64_t ldc, int kk, __m256 alpha) {
  __m256 c00 = _mm256_setzero_ps(), c10 = _mm256_setzero_ps(), c20 = _mm256_setzero_ps(), c30 = _mm256_setzero_ps(), c40 = _mm256_setzero_ps(), c50 = _mm256_setzero_ps(), c60 = _mm256_setzero_ps(), c70 = _mm256_setzero_ps();
  for (int k = 0; k < kk; ++k) {
    const __m256 b0 = _mm256_loadu_ps(B + k * ldb + 0);
    { const __m256 x = _mm256_broadcast_ss(A + 0 * lda + k);
      c00 = _mm256_fmadd_ps(x, b0, c00);
    }
    { const __m256 x = _mm256_broadcast_ss(A + 1 * lda + k);
      c10 = _mm256_fmadd_ps(x, b0, c10);
    }
    { const __m256 x = _mm256_broadcast_ss(A + 2 * lda + k);
      c20 = _mm256_fmadd_ps(x, b0, c20);
    }
    { const __m256 x = _mm256_broadcast_ss(A + 3 * lda + k);
      c30 = _mm256_fmadd_ps(x, b0, c30);
    }
    { const __m256 x = _mm256_broadcast_ss(A + 4 * lda + k);
      c40 = _mm256_fmadd_ps(x, b0, c40);
    }
    { const __m256 x = _mm256_broadcast_ss(A + 5 * lda + k);
      c50 = _mm256_fmadd_ps(x, b0, c50);
    }
    { const __m256 x = _mm256_broadcast_ss(A + 6 * lda + k);
      c60 = _mm256_fmadd_ps(x, b0, c60);
    }
    { const __m256 x = _mm256_broadcast_ss(A + 7 * lda + k);
      c70 = _mm256_fmadd_ps(x, b0, c70);
    }
  }
  _mm256_storeu_ps(C + 0 * ldc + 0, _mm256_mul_ps(alpha, c00));
  _mm256_storeu_ps(C + 1 * ldc + 0, _mm256_mul_ps(alpha, c10));
  _mm256_storeu_ps(C + 2 * ldc + 0, _mm256_mul_ps(alpha, c20));
  _mm256_storeu_ps(C + 3 * ldc + 0, _mm256_mul_ps(alpha, c30));
  _mm256_storeu_ps(C + 4 * ldc + 0, _mm256_mul_ps(alpha, c40));
  _mm256_storeu_ps(C + 5 * ldc + 0, _mm256_mul_ps(alpha, c50));
  _mm256_storeu_ps(C + 6 * ldc + 0, _mm256_mul_ps(alpha, c60));
  _mm256_storeu_ps(C + 7 * ldc + 0, _mm256_mul_ps(alpha, c70));
}

inline void block4x1(const float* __restrict A, int64_t lda, const float* __restrict B, int64_t ldb,
                        float* __restrict C, int64_t ldc, int kk, __m256 alpha) {
  __m256 c00 = _mm256_setzero_ps(), c10 = _mm256_setzero_ps(), c20 = _mm256_setzero_ps(), c30 = _mm256_setzero_ps();
  for (int k = 0; k < kk; ++k) {
    const __m256 b0 = _mm256_loadu_ps(B + k * ldb + 0);
    { const __m256 x = _mm256_broadcast_ss(A + 0 * lda + k);
      c00 = _mm256_fmadd_ps(x, b0, c00);
    }
    { const __m256 x = _mm256_broadcast_ss(A + 1 * lda + k);
      c10 = _mm256_fmadd_ps(x, b0, c10);
    }
    { const __m256 x = _mm256_broadcast_ss(A + 2 * lda + k);
      c20 = _mm256_fmadd_ps(x, b0, c20);
    }
    { const __m256 x = _mm256_broadcast_ss(A + 3 * lda + k);
      c30 = _mm256_fmadd_ps(x, b0, c30);
    }
  }
  _mm256_storeu_ps(C + 0 * ldc + 0, _mm256_mul_ps(alpha, c00));
  _mm256_storeu_ps(C + 1 * ldc + 0, _mm256_mul_ps(alpha, c10));
  _mm256_storeu_ps(C + 2 * ldc + 0, _mm256_mul_ps(alpha, c20));
  _mm256_storeu_ps(C + 3 * ldc + 0, _mm256_mul_ps(alpha, c30));
}

inline void block1x1(const float* __restrict A, int64_t lda, const float* __restrict B, int64_t ldb,
                        float* __restrict C, int64_t ldc, int kk, __m256 alpha) {
  __m256 c00 = _mm256_setzero_ps();
  for (int k = 0; k < kk; ++k) {
    const __m256 b0 = _mm256_loadu_ps(B + k * ldb + 0);
    { const __m256 x = _mm256_broadcast_ss(A + 0 * lda + k);
      c00 = _mm256_fmadd_ps(x, b0, c00);
    }
  }
  _mm256_storeu_ps(C + 0 * ldc + 0, _mm256_mul_ps(alpha, c00));
}

// C[i][0:n] = alpha · Σ_k A[i][k] · B[k][0:n], i < m, k < kk, n a multiple of 8: 16-column
// strips in blocks of 6 rows (12 accumulators hide the FMA latency), then an 8-column strip.
__attribute__((noinline)) void gemm(const float* __restrict A, int64_t lda, const float* __restrict B, int64_t ldb,
                                    float* __restrict C, int64_t ldc, int m, int kk, int n, float alpha) {
  const __m256 a = _mm256_set1_ps(alpha);
  int c = 0;
  for (; c + 16 <= n; c += 16) {
    int i = 0;
    for (; i + 6 <= m; i += 6) block6x2(A + i * lda, lda, B + c, ldb, C + i * ldc + c, ldc, kk, a);
    for (; i + 3 <= m; i += 3) block3x2(A + i * lda, lda, B + c, ldb, C + i * ldc + c, ldc, kk, a);
    for (; i < m; ++i) block1x2(A + i * lda, lda, B + c, ldb, C + i * ldc + c, ldc, kk, a);
  }
  if (c < n) {
    int i = 0;
    for (; i + 8 <= m; i += 8) block8x1(A + i * lda, lda, B + c, ldb, C + i * ldc + c, ldc, kk, a);
    for (; i + 4 <= m; i += 4) block4x1(A + i * lda, lda, B + c, ldb, C + i * ldc + c, ldc, kk, a);
    for (; i < m; ++i) block1x1(A + i * lda, lda, B + c, ldb, C + i * ldc + c, ldc, kk, a);
  }
}

inline void gemm_n(int nv, const float* A, int64_t lda, const float* B, int64_t ldb, float* C, int64_t ldc, int m,
                   int kk, float alpha) {
  gemm(A, lda, B, ldb, C, ldc, m, kk, 8 * nv, alpha);
}

// dst[c][r] = src[r][c] for r < rows (rows padded with zeros up to a multiple of 8), c < cols
// (a multiple of 8): 8×8 blocks through AVX registers.
inline void transpose(const float* __restrict src, int64_t ls, int rows, int cols, float* __restrict dst, int64_t ld) {
  const int rp = (rows + 7) / 8 * 8;
  for (int r0 = 0; r0 < rp; r0 += 8) {
    for (int c0 = 0; c0 < cols; c0 += 8) {
      __m256 x[8];
      for (int t = 0; t < 8; ++t)
        x[t] = r0 + t < rows ? _mm256_loadu_ps(src + (r0 + t) * ls + c0) : _mm256_setzero_ps();
      const __m256 t0 = _mm256_unpacklo_ps(x[0], x[1]), t1 = _mm256_unpackhi_ps(x[0], x[1]);
      const __m256 t2 = _mm256_unpacklo_ps(x[2], x[3]), t3 = _mm256_unpackhi_ps(x[2], x[3]);
      const __m256 t4 = _mm256_unpacklo_ps(x[4], x[5]), t5 = _mm256_unpackhi_ps(x[4], x[5]);
      const __m256 t6 = _mm256_unpacklo_ps(x[6], x[7]), t7 = _mm256_unpackhi_ps(x[6], x[7]);
      const __m256 u0 = _mm256_shuffle_ps(t0, t2, 0x44), u1 = _mm256_shuffle_ps(t0, t2, 0xEE);
      const __m256 u2 = _mm256_shuffle_ps(t1, t3, 0x44), u3 = _mm256_shuffle_ps(t1, t3, 0xEE);
      const __m256 u4 = _mm256_shuffle_ps(t4, t6, 0x44), u5 = _mm256_shuffle_ps(t4, t6, 0xEE);
      const __m256 u6 = _mm256_shuffle_ps(t5, t7, 0x44), u7 = _mm256_shuffle_ps(t5, t7, 0xEE);
      float* o = dst + c0 * ld + r0;
      _mm256_storeu_ps(o + 0 * ld, _mm256_permute2f128_ps(u0, u4, 0x20));
      _mm256_storeu_ps(o + 1 * ld, _mm256_permute2f128_ps(u1, u5, 0x20));
      _mm256_storeu_ps(o + 2 * ld, _mm256_permute2f128_ps(u2, u6, 0x20));
      _mm256_storeu_ps(o + 3 * ld, _mm256_permute2f128_ps(u3, u7, 0x20));
      _mm256_storeu_ps(o + 4 * ld, _mm256_permute2f128_ps(u0, u4, 0x31));
      _mm256_storeu_ps(o + 5 * ld, _mm256_permute2f128_ps(u1, u5, 0x31));
      _mm256_storeu_ps(o + 6 * ld, _mm256_permute2f128_ps(u2, u6, 0x31));
      _mm256_storeu_ps(o + 7 * ld, _mm256_permute2f128_ps(u3, u7, 0x31));
    }
  }
}

// e^x for x <= 0 (Cephes' expf: range reduction by ln 2, degree-6 polynomial); x < -87.3 gives 0.
inline __m256 exp_neg(__m256 x) {
  const __m256 low = _mm256_set1_ps(-87.3f);
  const __m256 under = _mm256_cmp_ps(x, low, _CMP_LT_OQ);
  x = _mm256_max_ps(x, low);
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_andnot_ps(under, _mm256_mul_ps(p, _mm256_castsi256_ps(e)));
}

constexpr float kInf = std::numeric_limits<float>::infinity();

inline float hsum(__m256 x) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_shuffle_ps(t, t, 1)));
}

inline float hmax(__m256 x) {
  const __m128 s = _mm_max_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  const __m128 t = _mm_max_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_max_ss(t, _mm_shuffle_ps(t, t, 1)));
}

// Where each key may be seen: bias[j] = 0 (seen) or −inf (padding, or beyond tk), and for causal
// rows the lanes past the diagonal (diag[l][lane] = −inf for lane > l).
struct Seen {
  alignas(32) float bias[kMax];
  alignas(32) float diag[8][8];
  int blocks;  // 8-key blocks
  bool causal;
  Seen(bool causal_) : causal(causal_) {
    for (int l = 0; l < 8; ++l)
      for (int t = 0; t < 8; ++t) diag[l][t] = t > l ? -kInf : 0.f;
  }
  void set(const bool* keep, int tk, int tkp) {
    blocks = tkp / 8;
    for (int j = 0; j < tkp; ++j) bias[j] = j < tk && (keep == nullptr || keep[j]) ? 0.f : -kInf;
  }
  // The 8-key blocks row i needs (causal: up to its diagonal).
  inline int row_blocks(int i) const { return causal ? std::min(i / 8 + 1, blocks) : blocks; }
  inline __m256 add(const float* s, int i, int c) const {
    __m256 x = _mm256_add_ps(_mm256_loadu_ps(s + 8 * c), _mm256_load_ps(bias + 8 * c));
    if (causal && c == i / 8) x = _mm256_add_ps(x, _mm256_load_ps(diag[i % 8]));
    return x;
  }
};

// Softmax of the rows [0, tq) of S (ld kMax) in place over the keys `seen` allows; lse[i] =
// log Σ_j exp(s_ij) (+inf for a row that sees nothing: its probabilities are all zero).
inline void softmax_rows(float* S, int tq, const Seen& seen, float* lse) {
  for (int i = 0; i < tq; ++i) {
    float* s = S + i * kMax;
    const int nb = seen.row_blocks(i);
    __m256 vm = _mm256_set1_ps(-kInf);
    for (int c = 0; c < nb; ++c) {
      const __m256 x = seen.add(s, i, c);
      _mm256_storeu_ps(s + 8 * c, x);
      vm = _mm256_max_ps(vm, x);
    }
    for (int c = nb; c < seen.blocks; ++c) _mm256_storeu_ps(s + 8 * c, _mm256_setzero_ps());
    const float mx = hmax(vm);
    if (mx == -kInf) {
      for (int c = 0; c < nb; ++c) _mm256_storeu_ps(s + 8 * c, _mm256_setzero_ps());
      lse[i] = kInf;
      continue;
    }
    const __m256 m = _mm256_set1_ps(mx);
    __m256 sum = _mm256_setzero_ps();
    for (int c = 0; c < nb; ++c) {
      const __m256 e = exp_neg(_mm256_sub_ps(_mm256_loadu_ps(s + 8 * c), m));
      _mm256_storeu_ps(s + 8 * c, e);
      sum = _mm256_add_ps(sum, e);
    }
    const float total = hsum(sum);
    const __m256 inv = _mm256_set1_ps(1.f / total);
    for (int c = 0; c < nb; ++c) _mm256_storeu_ps(s + 8 * c, _mm256_mul_ps(_mm256_loadu_ps(s + 8 * c), inv));
    lse[i] = mx + std::log(total);
  }
}

void check(const torch::Tensor& x, const char* name) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == torch::kFloat32 && x.dim() == 3 && x.stride(2) == 1,
              name, " must be a CPU float32 [B, T, H*D] tensor with contiguous rows");
}

std::vector<torch::Tensor> attention_forward(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                   int64_t heads, const torch::Tensor& keep, bool causal, double scale) {
  check(q, "q");
  check(k, "k");
  check(v, "v");
  TORCH_CHECK(heads > 0, "short attention: heads must be positive");
  const int64_t b = q.size(0), tq = q.size(1), tk = k.size(1), width = q.size(2), d = width / heads;
  TORCH_CHECK(heads > 0 && width == heads * d && d % 8 == 0 && d <= kMax && tq <= kMax && tk <= kMax && tq > 0 &&
                  tk > 0 && k.size(0) == b && v.sizes() == k.sizes() && k.size(2) == width,
              "short attention: unsupported shapes q ", q.sizes(), ", k ", k.sizes(), ", v ", v.sizes(), " with ", heads,
              " heads (sequences and head width at most ", kMax, ", head width a multiple of 8)");
  TORCH_CHECK(keep.numel() == 0 || (keep.scalar_type() == torch::kBool && keep.is_contiguous() && keep.numel() == b * tk),
              "short attention: the key mask must be a contiguous bool [B, Tk] tensor");
  auto out = torch::empty({b, tq, width}, q.options());
  auto lse = torch::empty({b, heads, tq}, q.options());
  const float *pq = q.data_ptr<float>(), *pk = k.data_ptr<float>(), *pv = v.data_ptr<float>();
  float *po = out.data_ptr<float>(), *pl = lse.data_ptr<float>();
  const bool* pm = keep.numel() > 0 ? keep.data_ptr<bool>() : nullptr;
  const int64_t sq = q.stride(1), sk = k.stride(1), sv = v.stride(1), bq = q.stride(0), bk = k.stride(0),
                bv = v.stride(0);
  const int tkp = (tk + 7) / 8 * 8, dv = d / 8;
  at::parallel_for(0, b * heads, 1, [&](int64_t begin, int64_t end) {
    alignas(32) float Kt[kMax * kMax];
    alignas(32) float S[kMax * kMax];
    Seen seen(causal);
    for (int64_t pair = begin; pair < end; ++pair) {
      const int64_t bi = pair / heads, h = pair % heads;
      const float* Q = pq + bi * bq + h * d;
      const float* K = pk + bi * bk + h * d;
      const float* V = pv + bi * bv + h * d;
      seen.set(pm == nullptr ? nullptr : pm + bi * tk, tk, tkp);
      transpose(K, sk, tk, d, Kt, kMax);
      gemm_n(tkp / 8, Q, sq, Kt, kMax, S, kMax, tq, d, static_cast<float>(scale));
      softmax_rows(S, tq, seen, pl + pair * tq);
      // V rows beyond tk are never read: the product runs over the tk keys.
      gemm_n(dv, S, kMax, V, sv, po + bi * tq * width + h * d, width, tq, tk, 1.f);
    }
  });
  return {out, lse};
}

std::vector<torch::Tensor> attention_backward(const torch::Tensor& go_in, const torch::Tensor& q, const torch::Tensor& k,
                                    const torch::Tensor& v, const torch::Tensor& out, const torch::Tensor& lse,
                                    int64_t heads, const torch::Tensor& keep, bool causal, double scale) {
  auto go = go_in.stride(2) == 1 ? go_in : go_in.contiguous();
  const int64_t b = q.size(0), tq = q.size(1), tk = k.size(1), width = q.size(2), d = width / heads;
  auto dq = torch::empty({b, tq, width}, q.options());
  auto dk = torch::empty({b, tk, width}, q.options());
  auto dvt = torch::empty({b, tk, width}, q.options());
  const float *pq = q.data_ptr<float>(), *pk = k.data_ptr<float>(), *pv = v.data_ptr<float>(),
              *po = out.data_ptr<float>(), *pg = go.data_ptr<float>(), *pl = lse.data_ptr<float>();
  float *pdq = dq.data_ptr<float>(), *pdk = dk.data_ptr<float>(), *pdv = dvt.data_ptr<float>();
  const bool* pm = keep.numel() > 0 ? keep.data_ptr<bool>() : nullptr;
  const int64_t sq = q.stride(1), sk = k.stride(1), sv = v.stride(1), so = out.stride(1), sg = go.stride(1);
  const int64_t bq = q.stride(0), bk = k.stride(0), bv = v.stride(0), bo = out.stride(0), bg = go.stride(0);
  const int tkp = (tk + 7) / 8 * 8, nvd = d / 8;
  const float sc = static_cast<float>(scale);
  at::parallel_for(0, b * heads, 1, [&](int64_t begin, int64_t end) {
    alignas(32) float Kt[kMax * kMax];
    alignas(32) float P[kMax * kMax];
    alignas(32) float dP[kMax * kMax];
    alignas(32) float T[kMax * kMax];
    Seen seen(causal);
    for (int64_t pair = begin; pair < end; ++pair) {
      const int64_t bi = pair / heads, h = pair % heads;
      const float* Q = pq + bi * bq + h * d;
      const float* K = pk + bi * bk + h * d;
      const float* V = pv + bi * bv + h * d;
      const float* O = po + bi * bo + h * d;
      const float* G = pg + bi * bg + h * d;
      const float* L = pl + pair * tq;
      seen.set(pm == nullptr ? nullptr : pm + bi * tk, tk, tkp);
      transpose(K, sk, tk, d, Kt, kMax);
      gemm_n(tkp / 8, Q, sq, Kt, kMax, P, kMax, tq, d, sc);  // scores again
      for (int i = 0; i < tq; ++i) {
        float* p = P + i * kMax;
        const float l = L[i];
        const int nb = l == kInf ? 0 : seen.row_blocks(i);
        const __m256 lv = _mm256_set1_ps(l);
        for (int c = 0; c < nb; ++c) _mm256_storeu_ps(p + 8 * c, exp_neg(_mm256_sub_ps(seen.add(p, i, c), lv)));
        for (int c = nb; c < seen.blocks; ++c) _mm256_storeu_ps(p + 8 * c, _mm256_setzero_ps());
      }
      transpose(V, sv, tk, d, Kt, kMax);                      // Vt
      gemm_n(tkp / 8, G, sg, Kt, kMax, dP, kMax, tq, d, 1.f);   // dP = dO · Vᵀ
      for (int i = 0; i < tq; ++i) {
        const float* g = G + i * sg;
        const float* o = O + i * so;
        __m256 acc = _mm256_setzero_ps();
        for (int c = 0; c < nvd; ++c) acc = _mm256_fmadd_ps(_mm256_loadu_ps(g + 8 * c), _mm256_loadu_ps(o + 8 * c), acc);
        const float di = hsum(acc);
        const __m256 dv8 = _mm256_set1_ps(di);
        float* p = P + i * kMax;
        float* ds = dP + i * kMax;
        for (int c = 0; c < tkp / 8; ++c)  // dS = P ⊙ (dP − D)
          _mm256_storeu_ps(ds + 8 * c, _mm256_mul_ps(_mm256_loadu_ps(p + 8 * c),
                                                     _mm256_sub_ps(_mm256_loadu_ps(ds + 8 * c), dv8)));
      }
      // dV = Pᵀ · dO
      transpose(P, kMax, tq, tkp, T, kMax);
      gemm_n(nvd, T, kMax, G, sg, pdv + bi * tk * width + h * d, width, tk, tq, 1.f);
      // dQ = scale · dS · K
      gemm_n(nvd, dP, kMax, K, sk, pdq + bi * tq * width + h * d, width, tq, tk, sc);
      // dK = scale · dSᵀ · Q
      transpose(dP, kMax, tq, tkp, T, kMax);
      gemm_n(nvd, T, kMax, Q, sq, pdk + bi * tk * width + h * d, width, tk, tq, sc);
    }
  });
  return {dq, dk, dvt};
}

}  // namespace

bool short_attention_available() { return true; }

#else  // no AVX2/FMA: model/attention.py asks short_attention_available() and keeps torch's SDPA

bool short_attention_available() { return false; }

#endif

namespace {

struct ShortAttention : public torch::autograd::Function<ShortAttention> {
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& q, const torch::Tensor& k,
                               const torch::Tensor& v, int64_t heads, const torch::Tensor& keep, bool causal,
                               double scale) {
#if defined(__AVX2__) && defined(__FMA__)
    auto result = attention_forward(q, k, v, heads, keep, causal, scale);
    ctx->save_for_backward({q, k, v, result[0], result[1], keep});
    ctx->saved_data["heads"] = heads;
    ctx->saved_data["causal"] = causal;
    ctx->saved_data["scale"] = scale;
    return result[0];
#else
    TORCH_CHECK(false, "short attention needs a CPU with AVX2 and FMA");
#endif
  }

  static torch::autograd::tensor_list backward(torch::autograd::AutogradContext* ctx,
                                               torch::autograd::tensor_list grads) {
#if defined(__AVX2__) && defined(__FMA__)
    const auto saved = ctx->get_saved_variables();
    auto g = attention_backward(grads[0], saved[0], saved[1], saved[2], saved[3], saved[4],
                                ctx->saved_data["heads"].toInt(), saved[5], ctx->saved_data["causal"].toBool(),
                                ctx->saved_data["scale"].toDouble());
    return {g[0], g[1], g[2], torch::Tensor(), torch::Tensor(), torch::Tensor(), torch::Tensor()};
#else
    TORCH_CHECK(false, "short attention needs a CPU with AVX2 and FMA");
#endif
  }
};

}  // namespace

torch::Tensor short_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, int64_t heads,
                              const torch::Tensor& keep, bool causal, double scale) {
  return ShortAttention::apply(q, k, v, heads, keep, causal, scale);
}
