// The CPU operators of matrixinfer/kernels (one extension, built once per machine).
//
// paged_mla_decode: weight-absorbed MLA decode attention straight from the paged latent cache, one query token
// per sequence: o_lat[s, h] = softmax_t(scale * q[s, h] . cache[t]) @ cache[t, :rank], over the
// context_lens[s] latents the block table points at. The PyTorch path gathers the latents into
// a dense [S, T, rank + rope] tensor first and then runs two batched matmuls and a softmax;
// here each latent row is read in place, once per head, from the block it lives in.
// Reference: MLAttention._attend_absorbed (tests compare the two).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <torch/csrc/inductor/aoti_torch/utils.h>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cstdint>
#include <optional>
#include <utility>
#include <type_traits>
#include <cmath>
#include <cstring>
#include <vector>

namespace {

template <typename T>
inline float to_f(T x) { return static_cast<float>(x); }

// A block's rows as float32: float caches are read in place; bfloat16 ones are widened into
// `wide` by a bit shift the compiler vectorises (a conversion per element in the dot products
// did not vectorise: 2.5x slower); float16 through its conversion.
inline const float* widen(const float* src, int64_t, float*) { return src; }

inline const float* widen(const c10::BFloat16* src, int64_t n, float* __restrict wide) {
  const uint16_t* __restrict bits = reinterpret_cast<const uint16_t*>(src);
  uint32_t* __restrict out = reinterpret_cast<uint32_t*>(wide);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) out[i] = static_cast<uint32_t>(bits[i]) << 16;
  return wide;
}

inline const float* widen(const c10::Half* src, int64_t n, float* __restrict wide) {
  for (int64_t i = 0; i < n; ++i) wide[i] = static_cast<float>(src[i]);
  return wide;
}

// G heads' scores of one latent row: G independent accumulators of 16 lanes share each load
// of the row (one accumulator per head is a chain of dependent FMAs: 18 % slower at 512 + 64).
// out[g * stride] <- q[g] . row for g < G.
template <int G>
inline void dots(const float* __restrict q, const float* __restrict row, int64_t D, float* __restrict out,
                 int64_t stride) {
  float acc[G][16] = {};
  int64_t d0 = 0;
  for (; d0 + 16 <= D; d0 += 16) {
    for (int g = 0; g < G; ++g) {
      const float* __restrict qg = q + g * D + d0;
#pragma omp simd
      for (int l = 0; l < 16; ++l) acc[g][l] += qg[l] * row[d0 + l];
    }
  }
  for (int g = 0; g < G; ++g) {
    float total = 0.f;
    for (int64_t d = d0; d < D; ++d) total += q[g * D + d] * row[d];
#pragma omp simd reduction(+ : total)
    for (int l = 0; l < 16; ++l) total += acc[g][l];
    out[g * stride] = total;
  }
}

#if defined(__AVX512F__)
// Sixteen rows' scores against one query, lane j = q . row_j, for narrow latents (a multiple
// of 16, at most 128: the bundled model's 80): the rows' 16-lane partial sums are folded
// together by a tree of two-source permutes (15 adds for the 16 rows) instead of a horizontal
// sum of each row (4 shuffles and 4 adds each).
struct FoldIndex {
  __m512i lo[4], hi[4];  // level l folds groups of 2w lanes to w, w = 8 >> l
  FoldIndex() {
    for (int l = 0; l < 4; ++l) {
      const int w = 8 >> l, groups = 16 / (2 * w);  // a source's row groups, 2w lanes each
      alignas(64) int32_t a[16], b[16];
      for (int i = 0; i < 16; ++i) {
        const int g = i / w, k = i % w, from_y = g >= groups ? 16 : 0, base = (g % groups) * 2 * w;
        a[i] = from_y + base + k, b[i] = from_y + base + w + k;
      }
      lo[l] = _mm512_load_si512(a), hi[l] = _mm512_load_si512(b);
    }
  }
};

inline void scores16(const float* __restrict q, const float* __restrict rows, int64_t D, float* __restrict out) {
  static const FoldIndex fold;
  __m512 p[16];
  for (int j = 0; j < 16; ++j) {
    const float* __restrict row = rows + j * D;
    __m512 a = _mm512_mul_ps(_mm512_loadu_ps(q), _mm512_loadu_ps(row));
    for (int64_t d = 16; d < D; d += 16) a = _mm512_fmadd_ps(_mm512_loadu_ps(q + d), _mm512_loadu_ps(row + d), a);
    p[j] = a;
  }
  for (int l = 0, n = 16; l < 4; ++l, n /= 2)
    for (int i = 0; i < n / 2; ++i)
      p[i] = _mm512_add_ps(_mm512_permutex2var_ps(p[2 * i], fold.lo[l], p[2 * i + 1]),
                           _mm512_permutex2var_ps(p[2 * i], fold.hi[l], p[2 * i + 1]));
  _mm512_storeu_ps(out, p[0]);
}
#endif

// acc[h] += sum_j w[h, j] * block[j, :R] for every head: the block's rows weighted into the
// running sums. With AVX-512, 64 columns of four heads stay in registers across the block's rows
// (a sum per head and row otherwise loads and stores the whole [R] sum: the 512-wide case was
// bound by those loads and stores); elsewhere one head and row at a time.
#if defined(__AVX512F__)
template <int HN>
inline void weigh_columns(const float* __restrict block, int64_t D, int64_t rows, const float* __restrict w,
                          int64_t bs, float* __restrict acc, int64_t R, int64_t r0) {
  __m512 a[HN][4];
  for (int h = 0; h < HN; ++h)
    for (int c = 0; c < 4; ++c) a[h][c] = _mm512_loadu_ps(acc + h * R + r0 + 16 * c);
  for (int64_t j = 0; j < rows; ++j) {
    const float* __restrict row = block + j * D + r0;
    __m512 v[4];
    for (int c = 0; c < 4; ++c) v[c] = _mm512_loadu_ps(row + 16 * c);
    for (int h = 0; h < HN; ++h) {
      const __m512 wh = _mm512_set1_ps(w[h * bs + j]);
      for (int c = 0; c < 4; ++c) a[h][c] = _mm512_fmadd_ps(wh, v[c], a[h][c]);
    }
  }
  for (int h = 0; h < HN; ++h)
    for (int c = 0; c < 4; ++c) _mm512_storeu_ps(acc + h * R + r0 + 16 * c, a[h][c]);
}
#endif

inline void weigh_block(const float* __restrict block, int64_t D, int64_t rows, const float* __restrict w, int64_t bs,
                        float* __restrict acc, int64_t nh, int64_t R) {
#if defined(__AVX512F__)
  if (R % 64 == 0) {
    for (int64_t r0 = 0; r0 < R; r0 += 64) {
      int64_t h = 0;
      for (; h + 4 <= nh; h += 4) weigh_columns<4>(block, D, rows, w + h * bs, bs, acc + h * R, R, r0);
      for (; h + 2 <= nh; h += 2) weigh_columns<2>(block, D, rows, w + h * bs, bs, acc + h * R, R, r0);
      for (; h < nh; ++h) weigh_columns<1>(block, D, rows, w + h * bs, bs, acc + h * R, R, r0);
    }
    return;
  }
#endif
  for (int64_t h = 0; h < nh; ++h)
    for (int64_t j = 0; j < rows; ++j) {
      const float* __restrict row = block + j * D;
      const float wj = w[h * bs + j];
      float* __restrict a = acc + h * R;
#pragma omp simd
      for (int64_t r = 0; r < R; ++r) a[r] += wj * row[r];
    }
}

// Heads [h0, h1) of one sequence, one cache block at a time (flash-decoding's online softmax
// with a block as the tile): the block's rows are scored for every head, then, while they are
// still in L1, weighted into the running sums, rescaled when a head's maximum grows. Each
// latent row is read from memory once; scores and sums are float32.
template <typename scalar_t, int64_t D_, int64_t R_>
void attend(const scalar_t* __restrict q, const scalar_t* __restrict cache, const int64_t* __restrict table,
            int64_t n, scalar_t* __restrict out, int64_t h0, int64_t h1, int64_t D_rt, int64_t R_rt, int64_t bs,
            float scale, std::vector<float>& buf) {
  // widths known at compile time (D_, R_ > 0) let the compiler unroll the row loops fully
  const int64_t D = D_ > 0 ? D_ : D_rt, R = R_ > 0 ? R_ : R_rt;
  const int64_t nh = h1 - h0;
  buf.resize(nh * D + nh * bs + nh * R + 2 * nh + (std::is_same_v<scalar_t, float> ? 0 : bs * D));
  float* __restrict qf = buf.data();   // [nh, D] scaled queries
  float* __restrict sc = qf + nh * D;  // [nh, bs] this block's scores, then weights
  float* __restrict acc = sc + nh * bs;  // [nh, R] running weighted sums
  float* __restrict mx = acc + nh * R;   // [nh] running maxima
  float* __restrict sum = mx + nh;       // [nh] running softmax denominators
  float* __restrict wide = sum + nh;     // [bs, D] a 16-bit block widened to float32 once
  for (int64_t h = 0; h < nh; ++h)
    for (int64_t d = 0; d < D; ++d) qf[h * D + d] = to_f(q[(h0 + h) * D + d]) * scale;
  std::fill(acc, acc + nh * R, 0.f);
  for (int64_t start = 0; start < n; start += bs) {
    const int64_t rows = std::min(bs, n - start);
    const float* __restrict block = widen(cache + table[start / bs] * bs * D, rows * D, wide);
    int64_t j = 0;
#if defined(__AVX512F__)
    if (D % 16 == 0 && D <= 128)  // 16 rows then stay in L1 while each head rereads them
      for (; j + 16 <= rows; j += 16)
        for (int64_t h = 0; h < nh; ++h) scores16(qf + h * D, block + j * D, D, sc + h * bs + j);
#endif
    for (; j < rows; ++j) {  // the rest of the block's scores, G heads per pass over a row
      const float* __restrict row = block + j * D;
      int64_t h = 0;
      for (; h + 8 <= nh; h += 8) dots<8>(qf + h * D, row, D, sc + h * bs + j, bs);
      for (; h + 4 <= nh; h += 4) dots<4>(qf + h * D, row, D, sc + h * bs + j, bs);
      for (; h < nh; ++h) dots<1>(qf + h * D, row, D, sc + h * bs + j, bs);
    }
    for (int64_t h = 0; h < nh; ++h) {
      float* __restrict sh = sc + h * bs;
      float best = sh[0];
      for (int64_t j = 1; j < rows; ++j) best = sh[j] > best ? sh[j] : best;
      float* __restrict a = acc + h * R;
      if (start == 0) {
        mx[h] = best, sum[h] = 0.f;
      } else if (best > mx[h]) {  // a new maximum: shrink what was summed under the old one
        const float shrink = std::exp(mx[h] - best);
        sum[h] *= shrink;
#pragma omp simd
        for (int64_t r = 0; r < R; ++r) a[r] *= shrink;
        mx[h] = best;
      }
      const float m = mx[h];
      float total = 0.f;
#pragma omp simd reduction(+ : total)
      for (int64_t j = 0; j < rows; ++j) total += (sh[j] = std::exp(sh[j] - m));
      sum[h] += total;
    }
    weigh_block(block, D, rows, sc, bs, acc, nh, R);
  }
  for (int64_t h = 0; h < nh; ++h) {
    const float inv = 1.f / sum[h];
    for (int64_t r = 0; r < R; ++r) out[(h0 + h) * R + r] = static_cast<scalar_t>(acc[h * R + r] * inv);
  }
}

template <typename scalar_t, int64_t D_, int64_t R_>
void decode(const scalar_t* q, const scalar_t* cache, const int64_t* tables, const int64_t* lens, scalar_t* out,
            int64_t S, int64_t H, int64_t D, int64_t R, int64_t W, int64_t bs, float scale) {
  if (S >= at::get_num_threads()) {  // enough sequences: a thread takes whole sequences
    at::parallel_for(0, S, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> buf;
      for (int64_t s = begin; s < end; ++s)
        attend<scalar_t, D_, R_>(q + s * H * D, cache, tables + s * W, lens[s], out + s * H * R, 0, H, D, R, bs, scale, buf);
    });
  } else {  // few sequences (batch 1): split their heads
    at::parallel_for(0, S * H, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> buf;
      for (int64_t i = begin; i < end;) {
        const int64_t s = i / H, h0 = i % H, h1 = std::min(H, h0 + (end - i));
        attend<scalar_t, D_, R_>(q + s * H * D, cache, tables + s * W, lens[s], out + s * H * R, h0, h1, D, R, bs, scale, buf);
        i += h1 - h0;
      }
    });
  }
}

// the latent widths of the bundled model (64 + 16) and of DeepSeek-V2/V3 (512 + 64) get
// their own instantiations; any other width runs the generic one
template <typename scalar_t>
void decode_any(const scalar_t* q, const scalar_t* cache, const int64_t* tables, const int64_t* lens, scalar_t* out,
                int64_t S, int64_t H, int64_t D, int64_t R, int64_t W, int64_t bs, float scale) {
  if (D == 80 && R == 64)
    decode<scalar_t, 80, 64>(q, cache, tables, lens, out, S, H, D, R, W, bs, scale);
  else if (D == 576 && R == 512)
    decode<scalar_t, 576, 512>(q, cache, tables, lens, out, S, H, D, R, W, bs, scale);
  else
    decode<scalar_t, 0, 0>(q, cache, tables, lens, out, S, H, D, R, W, bs, scale);
}

at::Tensor paged_mla_decode(const at::Tensor& q, const at::Tensor& cache, const at::Tensor& block_tables,
                            const at::Tensor& context_lens, double scale, int64_t rank) {
  TORCH_CHECK(q.dim() == 3 && cache.dim() == 3 && block_tables.dim() == 2 && context_lens.dim() == 1,
              "paged_mla_decode: q [S, H, D], cache [blocks, block_size, D], block_tables [S, W], context_lens [S]");
  TORCH_CHECK(q.size(2) == cache.size(2) && rank <= q.size(2), "paged_mla_decode: latent widths differ");
  TORCH_CHECK(q.scalar_type() == cache.scalar_type(), "paged_mla_decode: q and cache dtypes differ");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && context_lens.scalar_type() == at::kLong,
              "paged_mla_decode: int64 block tables and lengths");
  TORCH_CHECK(cache.is_contiguous(), "paged_mla_decode: a contiguous cache");
  const int64_t S = q.size(0), H = q.size(1), D = q.size(2), W = block_tables.size(1), bs = cache.size(1);
  TORCH_CHECK(block_tables.size(0) == S && context_lens.size(0) == S, "paged_mla_decode: one table row per query");
  at::Tensor qc = q.contiguous(), tables = block_tables.contiguous(), lens = context_lens.contiguous();
  at::Tensor out = at::empty({S, H, rank}, q.options());
  const float sc = static_cast<float>(scale);
  switch (q.scalar_type()) {
    case at::kFloat:
      decode_any<float>(qc.data_ptr<float>(), cache.data_ptr<float>(), tables.data_ptr<int64_t>(),
                        lens.data_ptr<int64_t>(), out.data_ptr<float>(), S, H, D, rank, W, bs, sc);
      break;
    case at::kBFloat16:
      decode_any<at::BFloat16>(qc.data_ptr<at::BFloat16>(), cache.data_ptr<at::BFloat16>(),
                               tables.data_ptr<int64_t>(), lens.data_ptr<int64_t>(), out.data_ptr<at::BFloat16>(),
                               S, H, D, rank, W, bs, sc);
      break;
    case at::kHalf:
      decode_any<at::Half>(qc.data_ptr<at::Half>(), cache.data_ptr<at::Half>(), tables.data_ptr<int64_t>(),
                           lens.data_ptr<int64_t>(), out.data_ptr<at::Half>(), S, H, D, rank, W, bs, sc);
      break;
    default:
      TORCH_CHECK(false, "paged_mla_decode: float32, bfloat16 or float16, not ", q.scalar_type());
  }
  return out;
}

}  // namespace

// grouped_mm: rows grouped by expert times each expert's weights, the offsets on the device
// (no host sync): ATen's _grouped_mm, whose shape function accepts only bfloat16 under
// torch.compile, behind an operator of ours that says what it returns for every dtype.
at::Tensor grouped_mm(const at::Tensor& a, const at::Tensor& b, const at::Tensor& offs) {
  return at::_grouped_mm(a, b, offs);
}

// argmax_rows: the index of each row's largest value, the first one on ties (torch.argmax's
// answer): what greedy sampling does to every row of logits. ATen's CPU argmax reduces one
// element at a time; here a vectorised max over the row, then the first 64-wide chunk holding
// it, then the index inside that chunk. A row of -inf only (every token masked) answers 0, as
// torch.argmax does: the fast-math build's max starts from the lowest finite float, so such a
// row finds no element equal to it. A NaN wins, as in torch.argmax (the first NaN's index): the
// fast-math build assumes no NaNs in float compares, so they are found on the bits.
at::Tensor argmax_rows(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "argmax_rows: float32 [rows, n], got ", x.sizes());
  TORCH_CHECK(x.size(1) > 0, "argmax_rows: empty rows");
  const at::Tensor c = x.contiguous();
  const int64_t rows = c.size(0), n = c.size(1);
  at::Tensor out = at::empty({rows}, c.options().dtype(at::kLong));
  const float* data = c.data_ptr<float>();
  int64_t* idx = out.data_ptr<int64_t>();
  constexpr int64_t kChunk = 64;
  at::parallel_for(0, rows, std::max<int64_t>(1, (int64_t{1} << 16) / n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* row = data + r * n;
      const uint32_t* bits = reinterpret_cast<const uint32_t*>(row);
      float lanes[16];  // 16 running maxima, one per vector lane
      uint32_t nan[16] = {};  // lanes that met a NaN: exponent all ones, mantissa not zero
      for (int l = 0; l < 16; ++l) lanes[l] = row[std::min<int64_t>(l, n - 1)];
      int64_t j0 = 0;
      for (; j0 + 16 <= n; j0 += 16) {
#pragma omp simd
        for (int l = 0; l < 16; ++l) {
          lanes[l] = lanes[l] > row[j0 + l] ? lanes[l] : row[j0 + l];
          nan[l] |= (bits[j0 + l] & 0x7fffffffu) > 0x7f800000u;
        }
      }
      float m = lanes[0];
      uint32_t any_nan = 0;
      for (int l = 1; l < 16; ++l) m = std::max(m, lanes[l]);
      for (int l = 0; l < 16; ++l) any_nan |= nan[l];
      for (int64_t j = j0; j < n; ++j) {
        m = std::max(m, row[j]);
        any_nan |= (bits[j] & 0x7fffffffu) > 0x7f800000u;
      }
      if (any_nan) {
        int64_t at = 0;
        while ((bits[at] & 0x7fffffffu) <= 0x7f800000u) ++at;
        idx[r] = at;
        continue;
      }
      int64_t at = 0;
      for (int64_t c0 = 0; c0 < n; c0 += kChunk) {
        const int64_t e = std::min(n, c0 + kChunk);
        int hit = 0;
#pragma omp simd reduction(| : hit)
        for (int64_t j = c0; j < e; ++j) hit |= row[j] == m;
        if (hit) {
          at = c0;
          while (row[at] != m) ++at;
          break;
        }
      }
      idx[r] = at;
    }
  });
  return out;
}

// small_mm: y[p] = w[e(p)] @ x[p] for the few rows of a decode step, e(p) each row's expert
// (none: w holds one matrix, a dense linear). The rows are bucketed by expert here, so the
// caller neither sorts nor gathers. The weights come packed once after loading
// (kernels.pack_small_mm): per expert, blocks of 16 outputs, each block K steps of 16 outputs
// side by side ([E, N/16, K/V, 16, V], V = 2 bfloat16 pairs or 1 float32). A step broadcasts one
// input element (a bfloat16 pair) and multiplies it into 16 outputs at once, so the
// accumulators hold outputs, not partial dot products: no horizontal sums at the end, and each
// block's weights are one contiguous run read front to back, each weight once per four rows of
// its expert. Against nn.Linear's layout read in place (dot products along K, summed across
// lanes), 1.3-2.0x faster at 1 and 8 rows on the bundled model's shapes (AMD EPYC Zen 4, 1 and
// 2 threads, weights streamed from L3), within 1.2-1.6x of the weights' read time at one row.
// bfloat16: one input pair times 16 outputs' pairs per AVX512-BF16 dot-product instruction
// (float32 accumulation), or widened to float32 where the CPU lacks it. Reference: F.linear
// per row and expert (tests).
namespace {

constexpr int kBlock = 16;  // outputs per packed block (kernels.SMALL_MM_BLOCK)

#if defined(__AVX512F__)
#define MI_SMALL_MM 1
struct Simd {  // 16 float32 lanes: a block of 16 outputs is one register
  using reg = __m512;
  static constexpr int W = 16;
  static reg zero() { return _mm512_setzero_ps(); }
  static reg set1(float v) { return _mm512_set1_ps(v); }
  static reg load(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, reg v) { _mm512_storeu_ps(p, v); }
  static reg fma(reg a, reg b, reg c) { return _mm512_fmadd_ps(a, b, c); }
  // W bfloat16 pairs (2W values) -> the first and the second of each pair as float32
  static void widen_pairs(const c10::BFloat16* p, reg& first, reg& second) {
    const __m512i v = _mm512_loadu_si512(p);
    first = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
    second = _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
  }
};
#elif defined(__AVX2__) && defined(__FMA__)
#define MI_SMALL_MM 1
struct Simd {  // 8 float32 lanes: a block of 16 outputs is two registers
  using reg = __m256;
  static constexpr int W = 8;
  static reg zero() { return _mm256_setzero_ps(); }
  static reg set1(float v) { return _mm256_set1_ps(v); }
  static reg load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, reg v) { _mm256_storeu_ps(p, v); }
  static reg fma(reg a, reg b, reg c) { return _mm256_fmadd_ps(a, b, c); }
  static void widen_pairs(const c10::BFloat16* p, reg& first, reg& second) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    first = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
    second = _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
  }
};
#endif

#if defined(MI_SMALL_MM)
constexpr int kRegs = kBlock / Simd::W;      // registers per block (1 with AVX-512, 2 with AVX2)
constexpr int kRowTile = 4;                  // rows sharing each weight load
constexpr int64_t kChunkBlocks = 4;          // blocks per task: two threads share even one expert's work

// R rows times B packed blocks (float32 weights [B][K][16]) over all of K -> acc[r][b][j]
template <int R, int B>
inline void packed_tile(const float* const* x, const float* __restrict w, int64_t K,
                        Simd::reg (&acc)[R][B][kRegs]) {
  for (int64_t k = 0; k < K; ++k) {
    Simd::reg xv[R];
    for (int r = 0; r < R; ++r) xv[r] = Simd::set1(x[r][k]);
    for (int b = 0; b < B; ++b)
      for (int j = 0; j < kRegs; ++j) {
        const Simd::reg wv = Simd::load(w + (b * K + k) * kBlock + j * Simd::W);
        for (int r = 0; r < R; ++r) acc[r][b][j] = Simd::fma(xv[r], wv, acc[r][b][j]);
      }
  }
}

// bfloat16 weights [B][K/2][16][2]: one pair of inputs per step
template <int R, int B>
inline void packed_tile(const c10::BFloat16* const* x, const c10::BFloat16* __restrict w, int64_t K,
                        Simd::reg (&acc)[R][B][kRegs]) {
  const int64_t K2 = K / 2;
#if defined(__AVX512BF16__)
  for (int64_t k = 0; k < K2; ++k) {
    __m512bh xv[R];  // the pair, broadcast to every lane
    for (int r = 0; r < R; ++r)
      xv[r] = (__m512bh)_mm512_set1_epi32(*reinterpret_cast<const int32_t*>(x[r] + 2 * k));
    for (int b = 0; b < B; ++b) {
      const __m512bh wv = (__m512bh)_mm512_loadu_si512(w + (b * K2 + k) * 2 * kBlock);
      for (int r = 0; r < R; ++r) acc[r][b][0] = _mm512_dpbf16_ps(acc[r][b][0], xv[r], wv);
    }
  }
#else
  for (int64_t k = 0; k < K2; ++k) {
    Simd::reg x0[R], x1[R];
    for (int r = 0; r < R; ++r) x0[r] = Simd::set1(to_f(x[r][2 * k])), x1[r] = Simd::set1(to_f(x[r][2 * k + 1]));
    for (int b = 0; b < B; ++b)
      for (int j = 0; j < kRegs; ++j) {
        Simd::reg w0, w1;
        Simd::widen_pairs(w + ((b * K2 + k) * kBlock + j * Simd::W) * 2, w0, w1);
        for (int r = 0; r < R; ++r) acc[r][b][j] = Simd::fma(x1[r], w1, Simd::fma(x0[r], w0, acc[r][b][j]));
      }
  }
#endif
}

// float32 accumulators -> an output row: copied, or rounded to bfloat16 (nearest even)
inline void store_block(const float* src, float* dst) { std::copy(src, src + kBlock, dst); }

inline void store_block(const float* src, c10::BFloat16* dst) {
#if defined(__AVX512BF16__)
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(src)));
#else
  for (int i = 0; i < kBlock; ++i) dst[i] = static_cast<c10::BFloat16>(src[i]);
#endif
}

// R rows times blocks [nb0, nb1) of one expert's packed matrix (blocks of kBlock * K values)
// into rows y[r] (outputs nb * 16 on), B blocks per pass over K, then one at a time
template <typename T, int R, int B>
void rows_times(const T* const* x, const T* w, int64_t K, int64_t nb0, int64_t nb1, T* const* y) {
  auto pass = [&](auto tag, int64_t nb) {
    constexpr int BB = decltype(tag)::value;
    Simd::reg acc[R][BB][kRegs];
    for (int r = 0; r < R; ++r)
      for (int b = 0; b < BB; ++b)
        for (int j = 0; j < kRegs; ++j) acc[r][b][j] = Simd::zero();
    packed_tile<R, BB>(x, w + nb * kBlock * K, K, acc);
    alignas(64) float out[kBlock];
    for (int r = 0; r < R; ++r)
      for (int b = 0; b < BB; ++b) {
        for (int j = 0; j < kRegs; ++j) Simd::store(out + j * Simd::W, acc[r][b][j]);
        store_block(out, y[r] + (nb + b) * kBlock);
      }
  };
  int64_t nb = nb0;
  for (; nb + B <= nb1; nb += B) pass(std::integral_constant<int, B>{}, nb);
  for (; nb < nb1; ++nb) pass(std::integral_constant<int, 1>{}, nb);
}

// blocks per pass over K: R x B x kRegs accumulators, at most 16 of AVX-512's 32 registers or
// 8 of AVX2's 16, and at most 4 blocks (a task's chunk)
constexpr int kAccRegs = kRegs == 1 ? 16 : 8;
constexpr int blocks_per_pass(int rows) {
  return std::clamp(kAccRegs / (rows * kRegs), 1, static_cast<int>(kChunkBlocks));
}
#endif  // MI_SMALL_MM

// rows grouped by expert: the rows of expert e are order[start[e] .. start[e + 1])
struct Groups {
  std::vector<int64_t> order, start, experts;  // experts: those with rows
};

#if defined(MI_SMALL_MM)
template <typename T>
void small_mm_kernel(const T* x, const T* w, const Groups& groups, int64_t K, int64_t NB, T* out) {
  // tasks: (expert with rows, a range of kChunkBlocks blocks); a product too small to pay for
  // waking the threads (under ~2^17 multiply-adds) runs here
  const int64_t N = NB * kBlock;
  const int64_t chunks = (NB + kChunkBlocks - 1) / kChunkBlocks;
  const int64_t tasks = static_cast<int64_t>(groups.experts.size()) * chunks;
  auto run = [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t e = groups.experts[t / chunks], c = t % chunks;
      const int64_t* rows = groups.order.data() + groups.start[e];
      const int64_t count_e = groups.start[e + 1] - groups.start[e];
      const int64_t nb0 = c * kChunkBlocks, nb1 = std::min(NB, nb0 + kChunkBlocks);
      const T* we = w + e * N * K;
      for (int64_t i = 0; i < count_e; i += kRowTile) {
        const int count = static_cast<int>(std::min<int64_t>(kRowTile, count_e - i));
        const T* xr[kRowTile];
        T* yr[kRowTile];
        for (int r = 0; r < count; ++r) xr[r] = x + rows[i + r] * K, yr[r] = out + rows[i + r] * N;
        if (count == 4) {
          rows_times<T, 4, blocks_per_pass(4)>(xr, we, K, nb0, nb1, yr);
        } else {  // three rows as two and one
          if (count >= 2) rows_times<T, 2, blocks_per_pass(2)>(xr, we, K, nb0, nb1, yr);
          if (count & 1) rows_times<T, 1, blocks_per_pass(1)>(xr + count - 1, we, K, nb0, nb1, yr + count - 1);
        }
      }
    }
  };
  const int64_t rows_total = static_cast<int64_t>(groups.order.size());
  if (rows_total * N * K < (int64_t{1} << 17)) {
    run(0, tasks);
  } else {
    at::parallel_for(0, tasks, 1, run);
  }
}
#endif  // MI_SMALL_MM

}  // namespace

at::Tensor small_mm(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& experts) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 5 && w.size(3) == kBlock, "small_mm: x [P, K], w packed [E, N/16, K/V, 16, V], got ",
              x.sizes(), " and ", w.sizes());
  TORCH_CHECK(x.scalar_type() == w.scalar_type(), "small_mm: x and w differ in dtype");
  const int64_t V = x.scalar_type() == at::kBFloat16 ? 2 : 1;
  TORCH_CHECK(w.size(4) == V && x.size(1) == w.size(2) * V, "small_mm: x [P, K] with K = ", x.size(1),
              " against packed w ", w.sizes(), " (V = ", V, ")");
  const at::Tensor xc = x.contiguous(), wc = w.contiguous();
  const int64_t P = xc.size(0), K = xc.size(1), E = wc.size(0), NB = wc.size(1);
  Groups groups;  // a counting sort of the rows by expert
  groups.order.resize(P);
  groups.start.assign(E + 1, 0);
  if (experts.has_value()) {
    TORCH_CHECK(experts->dim() == 1 && experts->size(0) == P, "small_mm: experts [P], got ", experts->sizes());
    const at::Tensor ex = experts->to(at::kLong).contiguous();
    const int64_t* ep = ex.data_ptr<int64_t>();
    for (int64_t p = 0; p < P; ++p) {
      TORCH_CHECK(0 <= ep[p] && ep[p] < E, "small_mm: row ", p, " names expert ", ep[p], " of ", E);
      ++groups.start[ep[p] + 1];
    }
    for (int64_t e = 0; e < E; ++e) groups.start[e + 1] += groups.start[e];
    std::vector<int64_t> fill(groups.start.begin(), groups.start.end() - 1);
    for (int64_t p = 0; p < P; ++p) groups.order[fill[ep[p]]++] = p;
  } else {
    TORCH_CHECK(E == 1, "small_mm: without experts, w holds one matrix");
    for (int64_t p = 0; p < P; ++p) groups.order[p] = p;
    groups.start[1] = P;
  }
  for (int64_t e = 0; e < E; ++e)
    if (groups.start[e + 1] > groups.start[e]) groups.experts.push_back(e);
  at::Tensor out = at::empty({P, NB * kBlock}, xc.options());
#if defined(MI_SMALL_MM)
  if (xc.scalar_type() == at::kFloat) {
    small_mm_kernel<float>(xc.data_ptr<float>(), wc.data_ptr<float>(), groups, K, NB, out.data_ptr<float>());
    return out;
  }
  if (xc.scalar_type() == at::kBFloat16) {
    small_mm_kernel<c10::BFloat16>(xc.data_ptr<c10::BFloat16>(), wc.data_ptr<c10::BFloat16>(), groups, K, NB,
                                   out.data_ptr<c10::BFloat16>());
    return out;
  }
#endif
  TORCH_CHECK(false, "small_mm: not built for ", xc.scalar_type(), " on this CPU");  // the Python side probes this
}

TORCH_LIBRARY(matrixinfer, m) {
  m.def("paged_mla_decode(Tensor q, Tensor cache, Tensor block_tables, Tensor context_lens, float scale, "
        "int rank) -> Tensor");
  m.def("grouped_mm(Tensor a, Tensor b, Tensor offs) -> Tensor");
  m.def("argmax_rows(Tensor x) -> Tensor");
  m.def("small_mm(Tensor x, Tensor w, Tensor? experts) -> Tensor");
}

TORCH_LIBRARY_IMPL(matrixinfer, CPU, m) {
  m.impl("paged_mla_decode", paged_mla_decode);
  m.impl("grouped_mm", grouped_mm);
  m.impl("argmax_rows", argmax_rows);
  m.impl("small_mm", small_mm);
}

// C shims: the compiled decode graph's C++ launcher calls these directly (inductor's
// aot_inductor.custom_ops_to_c_shims, set by worker/compiled_decode.py from _C_SHIMS
// in kernels/__init__.py; the two must agree) instead of looking each operator up by name and
// calling it boxed through the dispatcher on every call.
using torch::aot_inductor::new_tensor_handle;
using torch::aot_inductor::tensor_handle_to_tensor_pointer;

extern "C" AOTITorchError aoti_torch_cpu_paged_mla_decode(AtenTensorHandle q, AtenTensorHandle cache,
    AtenTensorHandle block_tables, AtenTensorHandle context_lens, double scale, int64_t rank, AtenTensorHandle* ret0) {
  AOTI_TORCH_CONVERT_EXCEPTION_TO_ERROR_CODE({
    *ret0 = new_tensor_handle(paged_mla_decode(*tensor_handle_to_tensor_pointer(q), *tensor_handle_to_tensor_pointer(cache),
        *tensor_handle_to_tensor_pointer(block_tables), *tensor_handle_to_tensor_pointer(context_lens), scale, rank));
  });
}

extern "C" AOTITorchError aoti_torch_cpu_small_mm(AtenTensorHandle x, AtenTensorHandle w, AtenTensorHandle* experts,
                                                  AtenTensorHandle* ret0) {
  AOTI_TORCH_CONVERT_EXCEPTION_TO_ERROR_CODE({
    std::optional<at::Tensor> e;
    if (experts != nullptr) e = *tensor_handle_to_tensor_pointer(*experts);
    *ret0 = new_tensor_handle(small_mm(*tensor_handle_to_tensor_pointer(x), *tensor_handle_to_tensor_pointer(w), e));
  });
}

extern "C" AOTITorchError aoti_torch_cpu_grouped_mm(AtenTensorHandle a, AtenTensorHandle b, AtenTensorHandle offs,
                                                    AtenTensorHandle* ret0) {
  AOTI_TORCH_CONVERT_EXCEPTION_TO_ERROR_CODE({
    *ret0 = new_tensor_handle(grouped_mm(*tensor_handle_to_tensor_pointer(a), *tensor_handle_to_tensor_pointer(b),
                                         *tensor_handle_to_tensor_pointer(offs)));
  });
}

// fp8_block_mm: y[p] = dequant(w[e(p)]) @ x[p] for weights stored as float8_e4m3fn with one float32
// scale per block of block_n x block_k weights (DeepSeek-V3's release format, `weight_scale_inv`),
// dequantized here block by block and never as a whole matrix. w [E, N, K] (or [N, K]: one
// matrix, experts none), scale [E, RB, KB], row_block [N] int32: the scale row of each output row
// (merged projections and tensor-parallel shards do not start on a block edge, so the row -> block
// map is explicit), k_shift: the column block grid's offset (an input-split shard starts inside a
// block): column k's scale is scale[.., (k + k_shift) / block_k]. The rows are bucketed by expert
// here (no sort, no host sync on the caller's side). A few rows per expert: each weight row is
// dequantized into a row buffer once and dotted with every row of its expert. Many rows: a chunk of
// weight rows dequantized into a float32 matrix (in parallel), then one GEMM per chunk. x float32
// or bfloat16 (the products in float32, the result rounded to x's dtype once). Reference:
// kernels.fp8_block_mm_reference (F.linear over kernels.fp8_block_dequant; tests compare them).
namespace {

// e4m3fn -> float32 on the bits, so the loop vectorises (a 256-entry table is a gather per weight):
// sign, then the 4 exponent + 3 mantissa bits moved to float32's fields with the bias raised from 7
// to 127; exponent 0 is subnormal, m * 2^-9. 0x7f / 0xff (e4m3fn's NaNs) come out as +-480:
// checkpoints hold none (the test compares every other byte with torch's conversion).
inline float float_of_bits(uint32_t u) { float f; std::memcpy(&f, &u, sizeof f); return f; }
inline uint32_t bits_of_float(float f) { uint32_t u; std::memcpy(&u, &f, sizeof u); return u; }

inline float fp8_e4m3_to_float(uint8_t b) {
  const uint32_t bits = b & 0x7fu;
  const float normal = float_of_bits((bits << 20) + (120u << 23));
  const float sub = static_cast<float>(bits) * 0.001953125f;  // 2^-9
  const float v = (bits >> 3) ? normal : sub;
  return float_of_bits(bits_of_float(v) | (static_cast<uint32_t>(b & 0x80u) << 24));
}


#if defined(__AVX2__) && defined(__FMA__)
#define MI_FP8_AVX2 1
// Faster, for scales below 2^7: the 7 magnitude bits moved under float32's exponent and mantissa
// with the sign kept, which float32 reads as exactly 2^-120 times the e4m3 value (its exponent 0
// lands on float32's subnormals, right too); the scale times 2^120 finishes the value, so
// raw * (s * 2^120) rounds exactly as value * s. (A process that sets denormals-are-zero would
// zero the e4m3 subnormals, below 2^-6 of e4m3's 448: 1/28,672 of a block's largest weight.)
inline __m256 fp8x8_raw(const uint8_t* p) {
  const __m256i b = _mm256_slli_epi32(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))), 24);
  return _mm256_castsi256_ps(_mm256_and_si256(_mm256_srai_epi32(b, 4), _mm256_set1_epi32(static_cast<int>(0x87F00000u))));
}
constexpr float kTwo120 = 1.329227995784916e36f;  // 2^120
#endif

// one weight row times one input row: the row's e4m3 weights decoded, scaled and multiplied as they
// are read (the one-row case: a decode step's linears)
inline float dot_row(const uint8_t* __restrict w, const float* __restrict srow, int64_t K, int64_t k_shift,
                     int64_t block_k, const float* __restrict x) {
  float acc = 0.f;
#if defined(MI_FP8_AVX2)
  __m256 vacc = _mm256_setzero_ps();
#endif
  for (int64_t k0 = 0; k0 < K;) {
    const int64_t kb = (k0 + k_shift) / block_k;
    const int64_t k1 = std::min(K, (kb + 1) * block_k - k_shift);
    const float s = srow[kb];
    int64_t k = k0;
#if defined(MI_FP8_AVX2)
    if (std::abs(s) < 128.f) {
      const __m256 s8 = _mm256_set1_ps(s * kTwo120);
      for (; k + 8 <= k1; k += 8)
        vacc = _mm256_fmadd_ps(_mm256_loadu_ps(x + k), _mm256_mul_ps(fp8x8_raw(w + k), s8), vacc);
    }
#endif
    for (; k < k1; ++k) acc += x[k] * (fp8_e4m3_to_float(w[k]) * s);
    k0 = k1;
  }
#if defined(MI_FP8_AVX2)
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, vacc);
  for (float l : lanes) acc += l;
#endif
  return acc;
}

constexpr int kTileRows = 4;  // weight rows per tile, a few input rows

#if defined(MI_FP8_AVX2)
// one input row times kTileRows decoded weight rows (w: kTileRows rows of K, one after another) -> y[0..3]
inline void tile_dots(const float* __restrict x, const float* __restrict w, int64_t K, float* __restrict y) {
  __m256 acc[kTileRows];
  for (int j = 0; j < kTileRows; ++j) acc[j] = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 8 <= K; k += 8) {
    const __m256 xv = _mm256_loadu_ps(x + k);
    for (int j = 0; j < kTileRows; ++j) acc[j] = _mm256_fmadd_ps(xv, _mm256_loadu_ps(w + j * K + k), acc[j]);
  }
  for (int j = 0; j < kTileRows; ++j) {
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, acc[j]);
    float sum = 0.f;
    for (float l : lanes) sum += l;
    for (int64_t t = k; t < K; ++t) sum += x[t] * w[j * K + t];
    y[j] = sum;
  }
}
#endif

inline void dequant_row(const uint8_t* __restrict w, const float* __restrict srow, int64_t K, int64_t k_shift,
                        int64_t block_k, float* __restrict out) {
  for (int64_t k0 = 0; k0 < K;) {
    const int64_t kb = (k0 + k_shift) / block_k;
    const int64_t k1 = std::min(K, (kb + 1) * block_k - k_shift);
    const float s = srow[kb];
    int64_t k = k0;
#if defined(MI_FP8_AVX2)
    if (std::abs(s) < 128.f) {
      const __m256 s8 = _mm256_set1_ps(s * kTwo120);
      for (; k + 8 <= k1; k += 8) _mm256_storeu_ps(out + k, _mm256_mul_ps(fp8x8_raw(w + k), s8));
    }
#endif
    for (; k < k1; ++k) out[k] = fp8_e4m3_to_float(w[k]) * s;
    k0 = k1;
  }
}

}  // namespace

at::Tensor fp8_block_mm(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scale, const at::Tensor& row_block,
                        int64_t k_shift, int64_t block_k, const std::optional<at::Tensor>& experts) {
  TORCH_CHECK(x.dim() == 2 && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "fp8_block_mm: x float32 or bfloat16 [P, K], got ", x.scalar_type(), " ", x.sizes());
  TORCH_CHECK(w.scalar_type() == at::kFloat8_e4m3fn && (w.dim() == 2 || w.dim() == 3),
              "fp8_block_mm: w float8_e4m3fn [E, N, K] or [N, K], got ", w.scalar_type(), " ", w.sizes());
  const at::Tensor w3 = (w.dim() == 2 ? w.unsqueeze(0) : w).contiguous();
  const at::Tensor s3 = (scale.dim() == 2 ? scale.unsqueeze(0) : scale).to(at::kFloat).contiguous();
  const int64_t E = w3.size(0), N = w3.size(1), K = w3.size(2), P = x.size(0);
  TORCH_CHECK(x.size(1) == K, "fp8_block_mm: x has ", x.size(1), " columns, w ", K);
  TORCH_CHECK(block_k > 0 && k_shift >= 0 && s3.dim() == 3 && s3.size(0) == E &&
              (K == 0 || (K - 1 + k_shift) / block_k < s3.size(2)),
              "fp8_block_mm: scale ", s3.sizes(), " does not cover ", K, " columns (shift ", k_shift, ", block ", block_k, ")");
  const at::Tensor rb = row_block.to(at::kInt).contiguous();
  TORCH_CHECK(rb.numel() == N, "fp8_block_mm: row_block has ", rb.numel(), " entries, w ", N, " rows");
  const int32_t* rbp = rb.data_ptr<int32_t>();
  for (int64_t n = 0; n < N; ++n) TORCH_CHECK(rbp[n] >= 0 && rbp[n] < s3.size(1), "fp8_block_mm: row_block out of range");
  std::vector<std::vector<int64_t>> groups(E);
  if (experts.has_value()) {
    const at::Tensor ex = experts->to(at::kLong).contiguous();
    TORCH_CHECK(ex.numel() == P, "fp8_block_mm: experts has ", ex.numel(), " entries, x ", P, " rows");
    const int64_t* ep = ex.data_ptr<int64_t>();
    for (int64_t p = 0; p < P; ++p) {
      TORCH_CHECK(ep[p] >= 0 && ep[p] < E, "fp8_block_mm: expert ", ep[p], " out of range [0, ", E, ")");
      groups[ep[p]].push_back(p);
    }
  } else {
    TORCH_CHECK(E == 1, "fp8_block_mm: ", E, " matrices need experts");
    groups[0].resize(P);
    for (int64_t p = 0; p < P; ++p) groups[0][p] = p;
  }
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  at::Tensor out = at::empty({P, N}, xf.options());
  const uint8_t* wp = reinterpret_cast<const uint8_t*>(w3.data_ptr());
  const float* sp = s3.data_ptr<float>();
  const int64_t RB = s3.size(1), KB = s3.size(2);
  constexpr int64_t kFewRows = 16;  // up to this many rows per expert: fused dequantize-and-dot
  constexpr int64_t kChunk = 256;  // weight rows dequantized per GEMM, many rows
  for (int64_t e = 0; e < E; ++e) {
    const std::vector<int64_t>& rows = groups[e];
    const int64_t R = static_cast<int64_t>(rows.size());
    if (R == 0) continue;
    const bool all = !experts.has_value();
    const at::Tensor idx = all ? at::Tensor() : at::tensor(rows, xf.options().dtype(at::kLong));
    const at::Tensor xg = all ? xf : xf.index_select(0, idx);
    at::Tensor yg = all ? out : at::empty({R, N}, xf.options());
    const float* xp = xg.data_ptr<float>();
    float* yp = yg.data_ptr<float>();
    const uint8_t* we = wp + e * N * K;
    const float* se = sp + e * RB * KB;
    if (R <= kFewRows) {
      at::parallel_for(0, N, std::max<int64_t>(1, 4096 / std::max<int64_t>(K, 1)), [&](int64_t n0, int64_t n1) {
        if (R == 1) {
          for (int64_t n = n0; n < n1; ++n) yp[n] = dot_row(we + n * K, se + rbp[n] * KB, K, k_shift, block_k, xp);
          return;
        }
        std::vector<float> wrow(kTileRows * K);
        int64_t n = n0;
#if defined(MI_FP8_AVX2)
        for (; n + kTileRows <= n1; n += kTileRows) {  // 4 weight rows decoded, each input load used 4 times
          for (int j = 0; j < kTileRows; ++j)
            dequant_row(we + (n + j) * K, se + rbp[n + j] * KB, K, k_shift, block_k, wrow.data() + j * K);
          for (int64_t r = 0; r < R; ++r)
            tile_dots(xp + r * K, wrow.data(), K, yp + r * N + n);
        }
#endif
        for (; n < n1; ++n) {
          dequant_row(we + n * K, se + rbp[n] * KB, K, k_shift, block_k, wrow.data());
          for (int64_t r = 0; r < R; ++r) {
            const float* xr = xp + r * K;
            float acc = 0.f;
#pragma omp simd reduction(+ : acc)
            for (int64_t k = 0; k < K; ++k) acc += xr[k] * wrow[k];
            yp[r * N + n] = acc;
          }
        }
      });
    } else {
      at::Tensor wf = at::empty({std::min(kChunk, N), K}, xf.options());
      float* wfp = wf.data_ptr<float>();
      for (int64_t c0 = 0; c0 < N; c0 += kChunk) {
        const int64_t nc = std::min(kChunk, N - c0);
        at::parallel_for(0, nc, 1, [&](int64_t i0, int64_t i1) {
          for (int64_t i = i0; i < i1; ++i)
            dequant_row(we + (c0 + i) * K, se + rbp[c0 + i] * KB, K, k_shift, block_k, wfp + i * K);
        });
        yg.narrow(1, c0, nc).copy_(at::mm(xg, wf.narrow(0, 0, nc).t()));
      }
    }
    if (!all) out.index_copy_(0, idx, yg);
  }
  return out.to(x.scalar_type());
}

TORCH_LIBRARY_FRAGMENT(matrixinfer, m) {
  m.def("fp8_block_mm(Tensor x, Tensor w, Tensor scale, Tensor row_block, int k_shift, int block_k, "
        "Tensor? experts) -> Tensor");
}

TORCH_LIBRARY_IMPL(matrixinfer, CPU, m) {
  m.impl("fp8_block_mm", fp8_block_mm);
}
