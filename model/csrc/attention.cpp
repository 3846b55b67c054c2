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
#include <ATen/record_function.h>
#include <immintrin.h>

namespace {

constexpr int kMax = kShortAttentionMax;

// Products C = alpha · A · B on tiles: B [K][N] with rows of 8 or 16 floats per strip, A either
// [M][K] (row r at A + r·lda) or, AT, stored transposed as [K][M] (so Pᵀ·dO and dSᵀ·Q need no
// transpose). Accumulators are named variables: held in an array, GCC 12 kept them on the stack,
// a store after every FMA, which made an earlier version of this kernel no faster than torch's.
template <bool AT>
inline __m256 a_at(const float* A, int64_t lda, int r, int k) {
  return _mm256_broadcast_ss(AT ? A + static_cast<int64_t>(k) * lda + r : A + r * lda + k);
}

#define ACC2(r) __m256 c##r##0 = _mm256_setzero_ps(), c##r##1 = _mm256_setzero_ps()
#define FMA2(r)                                        \
  {                                                    \
    const __m256 x = a_at<AT>(A, lda, r, k);           \
    c##r##0 = _mm256_fmadd_ps(x, b0, c##r##0);         \
    c##r##1 = _mm256_fmadd_ps(x, b1, c##r##1);         \
  }
#define OUT2(r)                                                         \
  _mm256_storeu_ps(C + (r) * ldc, _mm256_mul_ps(alpha, c##r##0));     \
  _mm256_storeu_ps(C + (r) * ldc + 8, _mm256_mul_ps(alpha, c##r##1))
#define ACC1(r) __m256 c##r = _mm256_setzero_ps()
#define FMA1(r) c##r = _mm256_fmadd_ps(a_at<AT>(A, lda, r, k), b0, c##r)
#define OUT1(r) _mm256_storeu_ps(C + (r) * ldc, _mm256_mul_ps(alpha, c##r))

// 6 rows × 16 columns: 12 accumulators, enough independent FMAs to hide their latency.
template <bool AT>
inline void block6x16(const float* A, int64_t lda, const float* B, int64_t ldb, float* C, int64_t ldc, int k0, int k1,
                      __m256 alpha) {
  ACC2(0); ACC2(1); ACC2(2); ACC2(3); ACC2(4); ACC2(5);
  for (int k = k0; k < k1; ++k) {
    const __m256 b0 = _mm256_loadu_ps(B + k * ldb), b1 = _mm256_loadu_ps(B + k * ldb + 8);
    FMA2(0); FMA2(1); FMA2(2); FMA2(3); FMA2(4); FMA2(5);
  }
  OUT2(0); OUT2(1); OUT2(2); OUT2(3); OUT2(4); OUT2(5);
}

template <bool AT>
inline void block1x16(const float* A, int64_t lda, const float* B, int64_t ldb, float* C, int64_t ldc, int k0, int k1,
                      __m256 alpha) {
  ACC2(0);
  for (int k = k0; k < k1; ++k) {
    const __m256 b0 = _mm256_loadu_ps(B + k * ldb), b1 = _mm256_loadu_ps(B + k * ldb + 8);
    FMA2(0);
  }
  OUT2(0);
}

template <bool AT>
inline void block4x16(const float* A, int64_t lda, const float* B, int64_t ldb, float* C, int64_t ldc, int k0, int k1,
                      __m256 alpha) {
  ACC2(0); ACC2(1); ACC2(2); ACC2(3);
  for (int k = k0; k < k1; ++k) {
    const __m256 b0 = _mm256_loadu_ps(B + k * ldb), b1 = _mm256_loadu_ps(B + k * ldb + 8);
    FMA2(0); FMA2(1); FMA2(2); FMA2(3);
  }
  OUT2(0); OUT2(1); OUT2(2); OUT2(3);
}

template <bool AT>
inline void block2x16(const float* A, int64_t lda, const float* B, int64_t ldb, float* C, int64_t ldc, int k0, int k1,
                      __m256 alpha) {
  ACC2(0); ACC2(1);
  for (int k = k0; k < k1; ++k) {
    const __m256 b0 = _mm256_loadu_ps(B + k * ldb), b1 = _mm256_loadu_ps(B + k * ldb + 8);
    FMA2(0); FMA2(1);
  }
  OUT2(0); OUT2(1);
}

// 8 rows × 8 columns (the last strip of a width that is not a multiple of 16).
template <bool AT>
inline void block8x8(const float* A, int64_t lda, const float* B, int64_t ldb, float* C, int64_t ldc, int k0, int k1,
                     __m256 alpha) {
  ACC1(0); ACC1(1); ACC1(2); ACC1(3); ACC1(4); ACC1(5); ACC1(6); ACC1(7);
  for (int k = k0; k < k1; ++k) {
    const __m256 b0 = _mm256_loadu_ps(B + k * ldb);
    FMA1(0); FMA1(1); FMA1(2); FMA1(3); FMA1(4); FMA1(5); FMA1(6); FMA1(7);
  }
  OUT1(0); OUT1(1); OUT1(2); OUT1(3); OUT1(4); OUT1(5); OUT1(6); OUT1(7);
}

template <bool AT>
inline void block4x8(const float* A, int64_t lda, const float* B, int64_t ldb, float* C, int64_t ldc, int k0, int k1,
                     __m256 alpha) {
  ACC1(0); ACC1(1); ACC1(2); ACC1(3);
  for (int k = k0; k < k1; ++k) {
    const __m256 b0 = _mm256_loadu_ps(B + k * ldb);
    FMA1(0); FMA1(1); FMA1(2); FMA1(3);
  }
  OUT1(0); OUT1(1); OUT1(2); OUT1(3);
}

template <bool AT>
inline void block1x8(const float* A, int64_t lda, const float* B, int64_t ldb, float* C, int64_t ldc, int k0, int k1,
                     __m256 alpha) {
  ACC1(0);
  for (int k = k0; k < k1; ++k) {
    const __m256 b0 = _mm256_loadu_ps(B + k * ldb);
    FMA1(0);
  }
  OUT1(0);
}

#undef ACC2
#undef FMA2
#undef OUT2
#undef ACC1
#undef FMA1
#undef OUT1

// Which part of the reduction a row block needs when a causal mask zeroes part of A: all of it
// (kAll), k < the block's last row + 1 (kUpToRow: P·V, dS·K, whose A rows are queries), or
// k ≥ the block's first row (kFromRow: Pᵀ·dO, dSᵀ·Q, whose A rows are keys).
enum Reduce { kAll, kUpToRow, kFromRow };

// C[i][0:n] = alpha · Σ_k a(i, k) · B[k][0:n] for i < m, k < kk; n a multiple of 8.
template <bool AT>
__attribute__((noinline)) void gemm(const float* A, int64_t lda, const float* B, int64_t ldb, float* C, int64_t ldc,
                                    int m, int kk, int n, float alpha, Reduce reduce = kAll) {
  const __m256 a = _mm256_set1_ps(alpha);
  auto range = [&](int i, int rows, int* k0, int* k1) {
    *k0 = reduce == kFromRow ? std::min(i, kk) : 0;
    *k1 = reduce == kUpToRow ? std::min(i + rows, kk) : kk;
  };
  auto row = [&](int i) { return AT ? A + i : A + i * lda; };
  int k0, k1;
#define RUN(R, block)                                                            \
  {                                                                              \
    range(i, R, &k0, &k1);                                                       \
    block<AT>(row(i), lda, B + c, ldb, C + i * ldc + c, ldc, k0, k1, a);         \
    i += R;                                                                      \
  }
  int c = 0;
  for (; c + 16 <= n; c += 16) {  // blocks of 6 rows; the last 8 or fewer in blocks of 4, 2, 1
    int i = 0;
    while (m - i >= 6 && m - i != 8) RUN(6, block6x16)
    while (m - i >= 4) RUN(4, block4x16)
    while (m - i >= 2) RUN(2, block2x16)
    if (i < m) RUN(1, block1x16)
  }
  if (c < n) {
    int i = 0;
    while (m - i >= 8) RUN(8, block8x8)
    while (m - i >= 4) RUN(4, block4x8)
    while (i < m) RUN(1, block1x8)
  }
#undef RUN
}

// o[c·ld + r] = x[r][c] for an 8 × 8 block held in registers.
inline void transpose8(__m256 x0, __m256 x1, __m256 x2, __m256 x3, __m256 x4, __m256 x5, __m256 x6, __m256 x7,
                       float* o, int64_t ld) {
  const __m256 t0 = _mm256_unpacklo_ps(x0, x1), t1 = _mm256_unpackhi_ps(x0, x1);
  const __m256 t2 = _mm256_unpacklo_ps(x2, x3), t3 = _mm256_unpackhi_ps(x2, x3);
  const __m256 t4 = _mm256_unpacklo_ps(x4, x5), t5 = _mm256_unpackhi_ps(x4, x5);
  const __m256 t6 = _mm256_unpacklo_ps(x6, x7), t7 = _mm256_unpackhi_ps(x6, x7);
  const __m256 u0 = _mm256_shuffle_ps(t0, t2, 0x44), u1 = _mm256_shuffle_ps(t0, t2, 0xEE);
  const __m256 u2 = _mm256_shuffle_ps(t1, t3, 0x44), u3 = _mm256_shuffle_ps(t1, t3, 0xEE);
  const __m256 u4 = _mm256_shuffle_ps(t4, t6, 0x44), u5 = _mm256_shuffle_ps(t4, t6, 0xEE);
  const __m256 u6 = _mm256_shuffle_ps(t5, t7, 0x44), u7 = _mm256_shuffle_ps(t5, t7, 0xEE);
  _mm256_storeu_ps(o + 0 * ld, _mm256_permute2f128_ps(u0, u4, 0x20));
  _mm256_storeu_ps(o + 1 * ld, _mm256_permute2f128_ps(u1, u5, 0x20));
  _mm256_storeu_ps(o + 2 * ld, _mm256_permute2f128_ps(u2, u6, 0x20));
  _mm256_storeu_ps(o + 3 * ld, _mm256_permute2f128_ps(u3, u7, 0x20));
  _mm256_storeu_ps(o + 4 * ld, _mm256_permute2f128_ps(u0, u4, 0x31));
  _mm256_storeu_ps(o + 5 * ld, _mm256_permute2f128_ps(u1, u5, 0x31));
  _mm256_storeu_ps(o + 6 * ld, _mm256_permute2f128_ps(u2, u6, 0x31));
  _mm256_storeu_ps(o + 7 * ld, _mm256_permute2f128_ps(u3, u7, 0x31));
}

// dst[c][r] = src[r][c] for r < rows (rows padded with zeros up to a multiple of 8), c < cols
// (a multiple of 8): 8 × 8 blocks through AVX registers.
inline void transpose(const float* __restrict src, int64_t ls, int rows, int cols, float* __restrict dst, int64_t ld) {
  int r0 = 0;
  for (; r0 + 8 <= rows; r0 += 8) {
    const float* s = src + r0 * ls;
    for (int c0 = 0; c0 < cols; c0 += 8)
      transpose8(_mm256_loadu_ps(s + c0), _mm256_loadu_ps(s + ls + c0), _mm256_loadu_ps(s + 2 * ls + c0),
                 _mm256_loadu_ps(s + 3 * ls + c0), _mm256_loadu_ps(s + 4 * ls + c0), _mm256_loadu_ps(s + 5 * ls + c0),
                 _mm256_loadu_ps(s + 6 * ls + c0), _mm256_loadu_ps(s + 7 * ls + c0), dst + c0 * ld + r0, ld);
  }
  if (r0 < rows) {  // the last, partial block of rows
    for (int c0 = 0; c0 < cols; c0 += 8) {
      __m256 x[8];
      for (int t = 0; t < 8; ++t)
        x[t] = r0 + t < rows ? _mm256_loadu_ps(src + (r0 + t) * ls + c0) : _mm256_setzero_ps();
      transpose8(x[0], x[1], x[2], x[3], x[4], x[5], x[6], x[7], dst + c0 * ld + r0, ld);
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

// Where head h of batch element b starts in a [B, T, H·D] tensor, for pair = b·H + h.
struct Heads {
  int64_t heads, d;
  inline const float* at(const float* p, int64_t batch_stride, int64_t pair) const {
    return p + (pair / heads) * batch_stride + (pair % heads) * d;
  }
  inline float* at(float* p, int64_t batch_stride, int64_t pair) const {
    return p + (pair / heads) * batch_stride + (pair % heads) * d;
  }
};

// The scaled scores Q·Kᵀ of one pair into S (ld kMax), K transposed into Kt first.
inline void scores(const float* Q, int64_t sq, const float* K, int64_t sk, int tq, int tk, int d, int tkp, float scale,
                   float* Kt, float* S) {
  transpose(K, sk, tk, d, Kt, kMax);
  gemm<false>(Q, sq, Kt, kMax, S, kMax, tq, d, tkp, scale);
}

void check(const torch::Tensor& x, const char* name) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == torch::kFloat32 && x.dim() == 3 && x.stride(2) == 1,
              name, " must be a CPU float32 [B, T, H*D] tensor with contiguous rows");
}

std::vector<torch::Tensor> attention_forward(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                   int64_t heads, const torch::Tensor& keep, bool causal, double scale) {
  RECORD_FUNCTION("deepnet::short_attention_forward", std::vector<c10::IValue>({q, k, v}));
  check(q, "q");
  check(k, "k");
  check(v, "v");
  TORCH_CHECK(heads > 0, "short attention: heads must be positive");
  const int64_t b = q.size(0), tq = q.size(1), tk = k.size(1), width = q.size(2), d = width / heads;
  TORCH_CHECK(width == heads * d && d % 8 == 0 && d <= kMax && tq <= kMax && tk <= kMax && tq > 0 &&
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
  const int tkp = (tk + 7) / 8 * 8;
  const Heads where{heads, d};
  at::parallel_for(0, b * heads, 1, [&](int64_t begin, int64_t end) {
    alignas(32) float Kt[kMax * kMax];
    alignas(32) float S[kMax * kMax];
    Seen seen(causal);
    for (int64_t pair = begin; pair < end; ++pair) {
      const float* V = where.at(pv, bv, pair);
      seen.set(pm == nullptr ? nullptr : pm + pair / heads * tk, tk, tkp);
      scores(where.at(pq, bq, pair), sq, where.at(pk, bk, pair), sk, tq, tk, d, tkp, static_cast<float>(scale), Kt, S);
      softmax_rows(S, tq, seen, pl + pair * tq);
      // V rows beyond tk are never read: the product runs over the tk keys.
      gemm<false>(S, kMax, V, sv, where.at(po, tq * width, pair), width, tq, tk, d, 1.f, causal ? kUpToRow : kAll);
    }
  });
  return {out, lse};
}

std::vector<torch::Tensor> attention_backward(const torch::Tensor& go_in, const torch::Tensor& q, const torch::Tensor& k,
                                    const torch::Tensor& v, const torch::Tensor& out, const torch::Tensor& lse,
                                    int64_t heads, const torch::Tensor& keep, bool causal, double scale) {
  RECORD_FUNCTION("deepnet::short_attention_backward", std::vector<c10::IValue>({go_in}));
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
  const Heads where{heads, d};
  at::parallel_for(0, b * heads, 1, [&](int64_t begin, int64_t end) {
    alignas(32) float Kt[kMax * kMax];
    alignas(32) float P[kMax * kMax];
    alignas(32) float dP[kMax * kMax];
    Seen seen(causal);
    for (int64_t pair = begin; pair < end; ++pair) {
      const float *Q = where.at(pq, bq, pair), *K = where.at(pk, bk, pair), *V = where.at(pv, bv, pair);
      const float *O = where.at(po, bo, pair), *G = where.at(pg, bg, pair), *L = pl + pair * tq;
      seen.set(pm == nullptr ? nullptr : pm + pair / heads * tk, tk, tkp);
      scores(Q, sq, K, sk, tq, tk, d, tkp, sc, Kt, P);  // the forward's scores again
      for (int i = 0; i < tq; ++i) {
        float* p = P + i * kMax;
        const float l = L[i];
        const int nb = l == kInf ? 0 : seen.row_blocks(i);
        const __m256 lv = _mm256_set1_ps(l);
        for (int c = 0; c < nb; ++c) _mm256_storeu_ps(p + 8 * c, exp_neg(_mm256_sub_ps(seen.add(p, i, c), lv)));
        for (int c = nb; c < seen.blocks; ++c) _mm256_storeu_ps(p + 8 * c, _mm256_setzero_ps());
      }
      transpose(V, sv, tk, d, Kt, kMax);                      // Vt
      gemm<false>(G, sg, Kt, kMax, dP, kMax, tq, d, tkp, 1.f);  // dP = dO · Vᵀ
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
      gemm<true>(P, kMax, G, sg, where.at(pdv, tk * width, pair), width, tk, tq, d, 1.f, causal ? kFromRow : kAll);
      // dQ = scale · dS · K
      gemm<false>(dP, kMax, K, sk, where.at(pdq, tq * width, pair), width, tq, tk, d, sc, causal ? kUpToRow : kAll);
      // dK = scale · dSᵀ · Q
      gemm<true>(dP, kMax, Q, sq, where.at(pdk, tk * width, pair), width, tk, tq, d, sc, causal ? kFromRow : kAll);
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
    return {};
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
    return {};
#endif
  }
};

}  // namespace

torch::Tensor short_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, int64_t heads,
                              const torch::Tensor& keep, bool causal, double scale) {
  return ShortAttention::apply(q, k, v, heads, keep, causal, scale);
}
