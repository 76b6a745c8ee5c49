// The all-reduce kernels: a one-shot push and a hierarchical (reduce-scatter, cross-island exchange,
// all-gather) push, each with a plain and a fused residual-add + RMSNorm epilogue.
// The protocol invariants I1..I8 are stated in ar_protocol.cuh; comments below name the one they rely on.
#include <algorithm>

#include "ar_launch.h"
#include "ar_protocol.cuh"
#include "pack_math.cuh"

namespace sgl_sm120 {
namespace {

struct CallArgs {
  const uint4* inp;
  const uint4* residual;  // fused only
  const uint4* weight;    // fused only
  uint4* out;             // plain: the sum; fused: residual_out
  uint4* norm_out;        // fused only
  long long num_packs;
  int rows;
  int packs_per_row;
  float eps;
  float inv_hidden;
};

// Fused kernels keep each thread's packs of a row in registers between the sum and the norm: a row has at
// most kMaxPacksPerThread x 1024 packs (hidden <= 65536 elements).
constexpr int kFusedThreads = 1024;

// ---------------------------------------------------------------------------------------------------------
// One-shot: every rank pushes its whole input into slot[rank] of every peer, then reduces all slots locally.
// Bytes per rank: (W-1) x payload out and in. Best at small payloads, on NVLink, and always at 2 ranks.
// ---------------------------------------------------------------------------------------------------------

template <int kWorld>
struct OneShotSlots {
  int parity;
  char* own_region;      // our region of this parity: slot[p] holds peer p's pushes
  long long push_offset;  // where our slot sits in every peer's region

  __device__ __forceinline__ OneShotSlots(const WorkspaceView& ws, int par)
      : parity(par), own_region(region_of(ws, ws.rank, par)), push_offset(ws.rank * ws.oneshot_slot_bytes) {}

  // Slot addresses come from the __grid_constant__ view on every use: arrays of pointers indexed by a
  // run-time rank would live in local memory.
  __device__ __forceinline__ char* poll(const WorkspaceView& ws, int peer, long long g) const {
    return own_region + peer * ws.oneshot_slot_bytes + g * kPackBytes;
  }

  // Destinations in rotated order so that the ranks do not all hit the same peer first.
  __device__ __forceinline__ void push_pack(const WorkspaceView& ws, long long g, uint4 v) const {
#pragma unroll
    for (int step = 1; step < kWorld; ++step) {
      const int peer = (ws.rank + step) % kWorld;
      store_volatile(region_of(ws, peer, parity) + push_offset + g * kPackBytes, v);
    }
  }

  // Wait for every peer's pack g at once, empty the slots (I4), and sum in rank order from bit-identical
  // operands (I2), so every rank gets the same bits.
  template <typename T>
  __device__ __forceinline__ Acc8 reduce_pack(const WorkspaceView& ws, unsigned long long seq, long long g,
                                              uint4 own) const {
    uint4 v[kWorld];
    bool pending = false;
#pragma unroll
    for (int p = 0; p < kWorld; ++p) {
      v[p] = p == ws.rank ? own : load_volatile(poll(ws, p, g));
      pending |= p != ws.rank && half_pack_has_empty(v[p]);
    }
    if (pending) {
      const long long start = static_cast<long long>(global_timer_ns());
      unsigned int spins = 0;
      while (pending) {
        pending = false;
        int missing = -1;
#pragma unroll
        for (int p = 0; p < kWorld; ++p) {
          if (p != ws.rank && half_pack_has_empty(v[p])) {
            v[p] = load_volatile(poll(ws, p, g));
            if (half_pack_has_empty(v[p])) {
              pending = true;
              missing = p;
            }
          }
        }
        if (pending && (++spins & 255u) == 0u) check_wait_bounds(ws, start, missing, kPhaseOneShot, seq);
      }
    }
#ifndef SGL_SM120_DEBUG_NO_CLEAR
#pragma unroll
    for (int p = 0; p < kWorld; ++p)
      if (p != ws.rank) store_volatile(poll(ws, p, g), empty_pack());
#endif
    Acc8 acc = unpack<T>(v[0]);
#pragma unroll
    for (int p = 1; p < kWorld; ++p) accumulate<T>(acc, v[p]);
    return acc;
  }
};

template <typename T, int kWorld>
__global__ void __launch_bounds__(1024) oneshot_all_reduce_kernel(const __grid_constant__ WorkspaceView ws, const __grid_constant__ CallArgs a) {
  pdl_wait_and_release();
  const unsigned long long seq = load_sequence(ws);
  const OneShotSlots<kWorld> slots(ws, parity_of(seq));
  const long long first = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
  const long long stride = static_cast<long long>(gridDim.x) * blockDim.x;

  // Push everything before waiting on anything: no wait below depends on a later push of our own.
  for (long long g = first; g < a.num_packs; g += stride) slots.push_pack(ws, g, remap_half_pack(a.inp[g]));
  for (long long g = first; g < a.num_packs; g += stride) {
    a.out[g] = round_pack<T>(slots.template reduce_pack<T>(ws, seq, g, remap_half_pack(a.inp[g])));
  }
  finish_call(ws, seq);
}

// Fused: a CTA per row (rows few, hidden large), so the RMSNorm row sum is a block reduction; a thread's
// packs j = threadIdx.x + k * blockDim.x, k < kPacks.
template <typename T, int kWorld, int kPacks>
__global__ void __launch_bounds__(kFusedThreads) oneshot_add_rmsnorm_kernel(const __grid_constant__ WorkspaceView ws, const __grid_constant__ CallArgs a) {
  __shared__ float s_red[33];
  pdl_wait_and_release();
  const unsigned long long seq = load_sequence(ws);
  const OneShotSlots<kWorld> slots(ws, parity_of(seq));
  const int ppr = a.packs_per_row;

  for (int row = blockIdx.x; row < a.rows; row += gridDim.x) {
#pragma unroll
    for (int k = 0; k < kPacks; ++k) {
      const int j = threadIdx.x + k * blockDim.x;
      if (j < ppr) {
        const long long g = static_cast<long long>(row) * ppr + j;
        slots.push_pack(ws, g, remap_half_pack(a.inp[g]));
      }
    }
  }
  for (int row = blockIdx.x; row < a.rows; row += gridDim.x) {
    uint4 r[kPacks], w[kPacks], res[kPacks], own[kPacks];
#pragma unroll
    for (int k = 0; k < kPacks; ++k) {  // loads that do not depend on the peers go first
      const int j = threadIdx.x + k * blockDim.x;
      if (j < ppr) {
        const long long g = static_cast<long long>(row) * ppr + j;
        own[k] = remap_half_pack(a.inp[g]);
        res[k] = a.residual[g];
        w[k] = a.weight[j];
      }
    }
    float squares = 0.f;
#pragma unroll
    for (int k = 0; k < kPacks; ++k) {
      const int j = threadIdx.x + k * blockDim.x;
      if (j < ppr) {
        const long long g = static_cast<long long>(row) * ppr + j;
        Acc8 acc = slots.template reduce_pack<T>(ws, seq, g, own[k]);
        accumulate<T>(acc, res[k]);
        r[k] = round_pack<T>(acc);  // residual_out, rounded once
        a.out[g] = r[k];
        squares += sum_of_squares<T>(r[k]);  // the norm starts from the rounded residual, as SGLang's
      }
    }
    const float inv_rms = rsqrtf(block_sum(squares, s_red) * a.inv_hidden + a.eps);
#pragma unroll
    for (int k = 0; k < kPacks; ++k) {
      const int j = threadIdx.x + k * blockDim.x;
      if (j < ppr) a.norm_out[static_cast<long long>(row) * ppr + j] = scale_pack<T>(r[k], w[k], inv_rms);
    }
  }
  finish_call(ws, seq);
}

// ---------------------------------------------------------------------------------------------------------
// Hierarchical: packs are owned round-robin by island position (owner = g % I).
//  1. reduce-scatter: push each pack to its owner inside the island;
//  2. the owner sums its island's packs in position order (fp32); with several islands it swaps the fp32
//     partial with its twins (same position in the other islands) and sums the partials in island order, so
//     twins agree bit for bit; then it rounds once (adding its residual when fused);
//  3. all-gather: the owner pushes the result to its island.
// Bytes per rank with I ranks an island and G islands: 2 (I-1)/I x payload inside the island and
// 2 (G-1)/I x payload (fp32) across. Flat two-shot is G = 1.
// Fused: the owner adds ITS residual. Tensor parallelism replicates the residual on every rank, so this is
// the caller's residual; the kernel does not check it.
// ---------------------------------------------------------------------------------------------------------

template <typename T>
struct HierStep {
  const WorkspaceView& ws;
  const Topology& t;
  int parity;
  unsigned long long seq;
  long long xs_base;  // cross-island slots: G x 2 chunk (fp32), after I reduce-scatter slots
  long long ag_base;  // all-gather slots: I x chunk, after those

  __device__ __forceinline__ HierStep(const WorkspaceView& w, const Topology& topo, unsigned long long s)
      : ws(w), t(topo), parity(parity_of(s)), seq(s) {
    xs_base = static_cast<long long>(t.island_size) * ws.chunk_slot_bytes;
    ag_base = xs_base + 2ll * t.num_islands * ws.chunk_slot_bytes;
  }

  __device__ __forceinline__ int owner(long long g) const { return static_cast<int>(g % t.island_size); }
  __device__ __forceinline__ long long offset(long long g) const { return g / t.island_size; }

  __device__ __forceinline__ char* rs_slot(int rank, int sender_pos, long long g) const {
    return region_of(ws, rank, parity) + sender_pos * ws.chunk_slot_bytes + offset(g) * kPackBytes;
  }
  __device__ __forceinline__ char* xs_slot(int rank, int sender_island, long long g) const {
    return region_of(ws, rank, parity) + xs_base + 2ll * sender_island * ws.chunk_slot_bytes +
           offset(g) * 2 * kPackBytes;
  }
  __device__ __forceinline__ char* ag_slot(int rank, int sender_pos, long long g) const {
    return region_of(ws, rank, parity) + ag_base + sender_pos * ws.chunk_slot_bytes + offset(g) * kPackBytes;
  }

  // Phase 1, by every rank for every pack it does not own.
  __device__ __forceinline__ void scatter(long long g, uint4 own) const {
    const int o = owner(g);
    if (o != t.my_index) store_volatile(rs_slot(t.island_ranks[o], t.my_index, g), own);
  }

  // Phase 2, by the owner: returns the fp32 sum over all ranks, identical on every twin.
  __device__ __forceinline__ Acc8 reduce_owned(long long g, uint4 own) const {
    Acc8 part;
    for (int pos = 0; pos < t.island_size; ++pos) {
      const uint4 v = pos == t.my_index ? own
                                        : consume_pack<false>(ws, rs_slot(ws.rank, pos, g), t.island_ranks[pos],
                                                              kPhaseReduceScatter, seq);
      if (pos == 0) {
        part = unpack<T>(v);
      } else {
        accumulate<T>(part, v);
      }
    }
    if (t.num_islands == 1) return part;
    // I2 for fp32 words: use the remapped partial ourselves too.
    const uint4 lo = make_uint4(remap_word(__float_as_uint(part.v[0])), remap_word(__float_as_uint(part.v[1])),
                                remap_word(__float_as_uint(part.v[2])), remap_word(__float_as_uint(part.v[3])));
    const uint4 hi = make_uint4(remap_word(__float_as_uint(part.v[4])), remap_word(__float_as_uint(part.v[5])),
                                remap_word(__float_as_uint(part.v[6])), remap_word(__float_as_uint(part.v[7])));
    for (int step = 1; step < t.num_islands; ++step) {
      const int island = (t.my_island + step) % t.num_islands;
      char* dst = xs_slot(t.twin_ranks[island], t.my_island, g);
      store_volatile(dst, lo);
      store_volatile(dst + kPackBytes, hi);
    }
    Acc8 total;
    for (int island = 0; island < t.num_islands; ++island) {
      Acc8 p;
      if (island == t.my_island) {
        p = partial_from(lo, hi);
      } else {
        char* src = xs_slot(ws.rank, island, g);
        const uint4 l = consume_pack<true>(ws, src, t.twin_ranks[island], kPhaseCrossIsland, seq);
        const uint4 h = consume_pack<true>(ws, src + kPackBytes, t.twin_ranks[island], kPhaseCrossIsland, seq);
        p = partial_from(l, h);
      }
      if (island == 0) {
        total = p;
      } else {
#pragma unroll
        for (int i = 0; i < 8; ++i) total.v[i] += p.v[i];
      }
    }
    return total;
  }

  // Phase 3 (send), by the owner: the final packed value to every other rank of the island.
  __device__ __forceinline__ void gather_send(long long g, uint4 v) const {
    for (int step = 1; step < t.island_size; ++step) {
      const int pos = (t.my_index + step) % t.island_size;
      store_volatile(ag_slot(t.island_ranks[pos], t.my_index, g), v);
    }
  }

  // Phase 3 (receive), by every rank for every pack it does not own.
  __device__ __forceinline__ uint4 gather_receive(long long g) const {
    const int o = owner(g);
    return consume_pack<false>(ws, ag_slot(ws.rank, o, g), t.island_ranks[o], kPhaseAllGather, seq);
  }
};

template <typename T>
__global__ void __launch_bounds__(1024) hier_all_reduce_kernel(const __grid_constant__ WorkspaceView ws,
                                       const __grid_constant__ CallArgs a, bool use_islands) {
  pdl_wait_and_release();
  const Topology& t = use_islands ? ws.islands : ws.flat;
  const HierStep<T> step(ws, t, load_sequence(ws));
  const long long first = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
  const long long stride = static_cast<long long>(gridDim.x) * blockDim.x;

  for (long long g = first; g < a.num_packs; g += stride) step.scatter(g, remap_half_pack(a.inp[g]));
  for (long long g = first; g < a.num_packs; g += stride) {
    if (step.owner(g) != t.my_index) continue;
    const uint4 v = remap_half_pack(round_pack<T>(step.reduce_owned(g, remap_half_pack(a.inp[g]))));
    a.out[g] = v;  // the remapped value, as the peers will see it (I2)
    step.gather_send(g, v);
  }
  for (long long g = first; g < a.num_packs; g += stride) {
    if (step.owner(g) == t.my_index) continue;
    a.out[g] = step.gather_receive(g);
  }
  finish_call(ws, step.seq);
}

template <typename T, int kPacks>
__global__ void __launch_bounds__(kFusedThreads) hier_add_rmsnorm_kernel(const __grid_constant__ WorkspaceView ws,
                                       const __grid_constant__ CallArgs a, bool use_islands) {
  __shared__ float s_red[33];
  pdl_wait_and_release();
  const Topology& t = use_islands ? ws.islands : ws.flat;
  const HierStep<T> step(ws, t, load_sequence(ws));
  const int ppr = a.packs_per_row;

  for (int row = blockIdx.x; row < a.rows; row += gridDim.x) {
#pragma unroll
    for (int k = 0; k < kPacks; ++k) {
      const int j = threadIdx.x + k * blockDim.x;
      if (j < ppr) {
        const long long g = static_cast<long long>(row) * ppr + j;
        step.scatter(g, remap_half_pack(a.inp[g]));
      }
    }
  }
  for (int row = blockIdx.x; row < a.rows; row += gridDim.x) {
    uint4 r[kPacks], w[kPacks];
#pragma unroll
    for (int k = 0; k < kPacks; ++k) {
      const int j = threadIdx.x + k * blockDim.x;
      if (j < ppr) {
        w[k] = a.weight[j];
        const long long g = static_cast<long long>(row) * ppr + j;
        if (step.owner(g) != t.my_index) continue;
        Acc8 acc = step.reduce_owned(g, remap_half_pack(a.inp[g]));
        accumulate<T>(acc, a.residual[g]);
        r[k] = remap_half_pack(round_pack<T>(acc));  // as the peers will see it (I2)
        a.out[g] = r[k];
        step.gather_send(g, r[k]);
      }
    }
    float squares = 0.f;
#pragma unroll
    for (int k = 0; k < kPacks; ++k) {
      const int j = threadIdx.x + k * blockDim.x;
      if (j < ppr) {
        const long long g = static_cast<long long>(row) * ppr + j;
        if (step.owner(g) != t.my_index) {
          r[k] = step.gather_receive(g);
          a.out[g] = r[k];
        }
        squares += sum_of_squares<T>(r[k]);
      }
    }
    const float inv_rms = rsqrtf(block_sum(squares, s_red) * a.inv_hidden + a.eps);
#pragma unroll
    for (int k = 0; k < kPacks; ++k) {
      const int j = threadIdx.x + k * blockDim.x;
      if (j < ppr) a.norm_out[static_cast<long long>(row) * ppr + j] = scale_pack<T>(r[k], w[k], inv_rms);
    }
  }
  finish_call(ws, step.seq);
}

// ---------------------------------------------------------------------------------------------------------
// Launch: grid <= SM count (I8), optional programmatic dependent launch.
// ---------------------------------------------------------------------------------------------------------

template <typename... KernelArgs, typename... Args>
cudaError_t launch_kernel(void (*kernel)(KernelArgs...), int blocks, int threads, const LaunchShape& shape,
                          cudaStream_t stream, Args... args) {
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(blocks);
  config.blockDim = dim3(threads);
  config.stream = stream;
  cudaLaunchAttribute attribute[1];
  attribute[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute[0].val.programmaticStreamSerializationAllowed = 1;
  config.attrs = attribute;
  config.numAttrs = shape.pdl ? 1 : 0;
  return cudaLaunchKernelEx(&config, kernel, args...);
}

int round_up_32(long long n) { return static_cast<int>(((n + 31) / 32) * 32); }

template <typename T, int kWorld>
cudaError_t launch_oneshot_plain(const WorkspaceView& ws, const CallArgs& a, int blocks, int threads,
                                 const LaunchShape& shape, cudaStream_t stream) {
  return launch_kernel(oneshot_all_reduce_kernel<T, kWorld>, blocks, threads, shape, stream, ws, a);
}

template <typename T>
cudaError_t launch_plain(const WorkspaceView& ws, Variant variant, const CallArgs& a, const LaunchShape& shape,
                         cudaStream_t stream) {
  const int threads = static_cast<int>(std::min<long long>(shape.threads, round_up_32(a.num_packs)));
  const long long wanted = (a.num_packs + threads - 1) / threads;
  const int blocks = static_cast<int>(std::max<long long>(1, std::min<long long>(wanted, shape.max_blocks)));
  if (variant != Variant::kOneShot) {
    return launch_kernel(hier_all_reduce_kernel<T>, blocks, threads, shape, stream, ws, a,
                         variant == Variant::kIsland);
  }
  switch (ws.world) {
    case 1: return launch_oneshot_plain<T, 1>(ws, a, blocks, threads, shape, stream);
    case 2: return launch_oneshot_plain<T, 2>(ws, a, blocks, threads, shape, stream);
    case 4: return launch_oneshot_plain<T, 4>(ws, a, blocks, threads, shape, stream);
    case 8: return launch_oneshot_plain<T, 8>(ws, a, blocks, threads, shape, stream);
    default: return cudaErrorInvalidValue;
  }
}

template <typename T, int kPacks>
cudaError_t launch_fused_packs(const WorkspaceView& ws, Variant variant, const CallArgs& a, int blocks,
                               int threads, const LaunchShape& shape, cudaStream_t stream) {
  if (variant != Variant::kOneShot) {
    return launch_kernel(hier_add_rmsnorm_kernel<T, kPacks>, blocks, threads, shape, stream, ws, a,
                         variant == Variant::kIsland);
  }
  switch (ws.world) {
    case 1: return launch_kernel(oneshot_add_rmsnorm_kernel<T, 1, kPacks>, blocks, threads, shape, stream, ws, a);
    case 2: return launch_kernel(oneshot_add_rmsnorm_kernel<T, 2, kPacks>, blocks, threads, shape, stream, ws, a);
    case 4: return launch_kernel(oneshot_add_rmsnorm_kernel<T, 4, kPacks>, blocks, threads, shape, stream, ws, a);
    case 8: return launch_kernel(oneshot_add_rmsnorm_kernel<T, 8, kPacks>, blocks, threads, shape, stream, ws, a);
    default: return cudaErrorInvalidValue;
  }
}

template <typename T>
cudaError_t launch_fused(const WorkspaceView& ws, Variant variant, const CallArgs& a, const LaunchShape& shape,
                         cudaStream_t stream) {
  const int threads = std::min(kFusedThreads, round_up_32(a.packs_per_row));
  const int blocks = std::max(1, std::min(a.rows, shape.max_blocks));
  const int packs = (a.packs_per_row + threads - 1) / threads;
  if (packs <= 1) return launch_fused_packs<T, 1>(ws, variant, a, blocks, threads, shape, stream);
  if (packs <= 2) return launch_fused_packs<T, 2>(ws, variant, a, blocks, threads, shape, stream);
  if (packs <= 4) return launch_fused_packs<T, 4>(ws, variant, a, blocks, threads, shape, stream);
  if (packs <= kMaxPacksPerThread) return launch_fused_packs<T, kMaxPacksPerThread>(ws, variant, a, blocks, threads,
                                                                                    shape, stream);
  return cudaErrorInvalidValue;  // hidden > kMaxFusedHidden: the Python side sends these to the fallback
}

}  // namespace

cudaError_t launch_all_reduce(const WorkspaceView& ws, Variant variant, ElemType type, const void* inp, void* out,
                              long long numel, const LaunchShape& shape, cudaStream_t stream) {
  CallArgs a{};
  a.inp = static_cast<const uint4*>(inp);
  a.out = static_cast<uint4*>(out);
  a.num_packs = numel / kElemsPerPack;
  if (type == ElemType::kBFloat16) return launch_plain<__nv_bfloat16>(ws, variant, a, shape, stream);
  return launch_plain<__half>(ws, variant, a, shape, stream);
}

cudaError_t launch_all_reduce_add_rmsnorm(const WorkspaceView& ws, Variant variant, ElemType type, const void* inp,
                                          const void* residual, const void* weight, void* norm_out,
                                          void* residual_out, int rows, int hidden, float eps,
                                          const LaunchShape& shape, cudaStream_t stream) {
  CallArgs a{};
  a.inp = static_cast<const uint4*>(inp);
  a.residual = static_cast<const uint4*>(residual);
  a.weight = static_cast<const uint4*>(weight);
  a.out = static_cast<uint4*>(residual_out);
  a.norm_out = static_cast<uint4*>(norm_out);
  a.rows = rows;
  a.packs_per_row = hidden / kElemsPerPack;
  a.num_packs = static_cast<long long>(rows) * a.packs_per_row;
  a.eps = eps;
  a.inv_hidden = 1.0f / static_cast<float>(hidden);
  if (type == ElemType::kBFloat16) return launch_fused<__nv_bfloat16>(ws, variant, a, shape, stream);
  return launch_fused<__half>(ws, variant, a, shape, stream);
}

}  // namespace sgl_sm120
