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

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <cmath>
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
    for (int64_t j = 0; j < rows; ++j) {  // the block's scores, G heads per pass over a row
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
      for (int64_t j = 0; j < rows; ++j) {
        const float* __restrict row = block + j * D;
        const float w = sh[j];
#pragma omp simd
        for (int64_t r = 0; r < R; ++r) a[r] += w * row[r];
      }
    }
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
// row finds no element equal to it. NaN rows are not defined here (logits have none).
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
      float lanes[16];  // 16 running maxima, one per vector lane
      for (int l = 0; l < 16; ++l) lanes[l] = row[std::min<int64_t>(l, n - 1)];
      int64_t j0 = 0;
      for (; j0 + 16 <= n; j0 += 16) {
#pragma omp simd
        for (int l = 0; l < 16; ++l) lanes[l] = lanes[l] > row[j0 + l] ? lanes[l] : row[j0 + l];
      }
      float m = lanes[0];
      for (int l = 1; l < 16; ++l) m = std::max(m, lanes[l]);
      for (int64_t j = j0; j < n; ++j) m = std::max(m, row[j]);
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

TORCH_LIBRARY(matrixinfer, m) {
  m.def("paged_mla_decode(Tensor q, Tensor cache, Tensor block_tables, Tensor context_lens, float scale, "
        "int rank) -> Tensor");
  m.def("grouped_mm(Tensor a, Tensor b, Tensor offs) -> Tensor");
  m.def("argmax_rows(Tensor x) -> Tensor");
}

TORCH_LIBRARY_IMPL(matrixinfer, CPU, m) {
  m.impl("paged_mla_decode", paged_mla_decode);
  m.impl("grouped_mm", grouped_mm);
  m.impl("argmax_rows", argmax_rows);
}
