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

// ---------------------------------------------------------------------------------------------------------
// One-shot: every rank pushes its whole input into slot[rank] of every peer, then reduces all slots locally.
// Bytes per rank: (W-1) x payload out and in. Best at small payloads and on NVLink.
// ---------------------------------------------------------------------------------------------------------

__device__ __forceinline__ char* oneshot_slot(const WorkspaceView& ws, int owner, int parity, int sender) {
  return region_of(ws, owner, parity) + static_cast<long long>(sender) * ws.oneshot_slot_bytes;
}

// Destinations in rotated order so that the ranks do not all hit the same peer first.
__device__ __forceinline__ void oneshot_push(const WorkspaceView& ws, int parity, long long g, uint4 v) {
  for (int step = 1; step < ws.world; ++step) {
    const int peer = (ws.rank + step) % ws.world;
    store_volatile(oneshot_slot(ws, peer, parity, ws.rank) + g * kPackBytes, v);
  }
}

// Sum in rank order 0..W-1 from bit-identical operands (I2), so every rank gets the same bits.
template <typename T>
__device__ __forceinline__ Acc8 oneshot_reduce(const WorkspaceView& ws, int parity, unsigned long long seq,
                                               long long g, uint4 own) {
  Acc8 acc;
  for (int src = 0; src < ws.world; ++src) {
    const uint4 v = src == ws.rank ? own
                                   : consume_pack<false>(ws, oneshot_slot(ws, ws.rank, parity, src) + g * kPackBytes,
                                                         src, kPhaseOneShot, seq);
    if (src == 0) {
      acc = unpack<T>(v);
    } else {
      accumulate<T>(acc, v);
    }
  }
  return acc;
}

template <typename T>
__global__ void __launch_bounds__(1024) oneshot_all_reduce_kernel(WorkspaceView ws, CallArgs a) {
  __shared__ unsigned long long s_seq;
  load_sequence(ws, &s_seq);
  __syncthreads();
  const unsigned long long seq = s_seq;
  const int parity = parity_of(seq);
  const long long first = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
  const long long stride = static_cast<long long>(gridDim.x) * blockDim.x;

  // Push everything before waiting on anything: no wait below depends on a push of our own that is later.
  for (long long g = first; g < a.num_packs; g += stride) oneshot_push(ws, parity, g, remap_half_pack(a.inp[g]));
  for (long long g = first; g < a.num_packs; g += stride) {
    const Acc8 acc = oneshot_reduce<T>(ws, parity, seq, g, remap_half_pack(a.inp[g]));
    a.out[g] = round_pack<T>(acc);
  }
  finish_call(ws, seq);
}

// Fused: CTA per row (rows few, hidden large), so the RMSNorm row sum is a plain block reduction.
template <typename T>
__global__ void __launch_bounds__(1024) oneshot_add_rmsnorm_kernel(WorkspaceView ws, CallArgs a) {
  __shared__ unsigned long long s_seq;
  __shared__ float s_red[33];
  load_sequence(ws, &s_seq);
  __syncthreads();
  const unsigned long long seq = s_seq;
  const int parity = parity_of(seq);
  const int ppr = a.packs_per_row;

  for (int row = blockIdx.x; row < a.rows; row += gridDim.x) {
    for (int j = threadIdx.x; j < ppr; j += blockDim.x) {
      const long long g = static_cast<long long>(row) * ppr + j;
      oneshot_push(ws, parity, g, remap_half_pack(a.inp[g]));
    }
  }
  for (int row = blockIdx.x; row < a.rows; row += gridDim.x) {
    float squares = 0.f;
    for (int j = threadIdx.x; j < ppr; j += blockDim.x) {
      const long long g = static_cast<long long>(row) * ppr + j;
      Acc8 acc = oneshot_reduce<T>(ws, parity, seq, g, remap_half_pack(a.inp[g]));
      accumulate<T>(acc, a.residual[g]);
      const uint4 r = round_pack<T>(acc);  // residual_out rounded once
      a.out[g] = r;
      squares += sum_of_squares<T>(r);  // the norm starts from the rounded residual, as SGLang's unfused path
    }
    const float inv_rms = rsqrtf(block_sum(squares, s_red) * a.inv_hidden + a.eps);
    for (int j = threadIdx.x; j < ppr; j += blockDim.x) {
      const long long g = static_cast<long long>(row) * ppr + j;
      a.norm_out[g] = scale_pack<T>(a.out[g], a.weight[j], inv_rms);  // re-read our own store
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

struct HierSlots {
  long long rs;  // reduce-scatter slots: I x chunk
  long long xs;  // cross-island slots: G x 2 chunk (fp32)
  long long ag;  // all-gather slots: I x chunk
};

__device__ __forceinline__ HierSlots hier_slots(const WorkspaceView& ws, const Topology& t) {
  HierSlots s;
  s.rs = 0;
  s.xs = static_cast<long long>(t.island_size) * ws.chunk_slot_bytes;
  s.ag = s.xs + 2ll * t.num_islands * ws.chunk_slot_bytes;
  return s;
}

template <typename T>
struct HierStep {
  const WorkspaceView& ws;
  const Topology& t;
  HierSlots s;
  int parity;
  unsigned long long seq;

  __device__ __forceinline__ int owner(long long g) const { return static_cast<int>(g % t.island_size); }
  __device__ __forceinline__ long long offset(long long g) const { return g / t.island_size; }

  __device__ __forceinline__ char* rs_slot(int rank, int sender_pos, long long g) const {
    return region_of(ws, rank, parity) + s.rs + sender_pos * ws.chunk_slot_bytes + offset(g) * kPackBytes;
  }
  __device__ __forceinline__ char* xs_slot(int rank, int sender_island, long long g) const {
    return region_of(ws, rank, parity) + s.xs + 2ll * sender_island * ws.chunk_slot_bytes +
           offset(g) * 2 * kPackBytes;
  }
  __device__ __forceinline__ char* ag_slot(int rank, int sender_pos, long long g) const {
    return region_of(ws, rank, parity) + s.ag + sender_pos * ws.chunk_slot_bytes + offset(g) * kPackBytes;
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
__global__ void __launch_bounds__(1024) hier_all_reduce_kernel(WorkspaceView ws, CallArgs a, bool use_islands) {
  __shared__ unsigned long long s_seq;
  load_sequence(ws, &s_seq);
  __syncthreads();
  const Topology& t = use_islands ? ws.islands : ws.flat;
  const HierStep<T> step{ws, t, hier_slots(ws, t), parity_of(s_seq), s_seq};
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
  finish_call(ws, s_seq);
}

template <typename T>
__global__ void __launch_bounds__(1024) hier_add_rmsnorm_kernel(WorkspaceView ws, CallArgs a, bool use_islands) {
  __shared__ unsigned long long s_seq;
  __shared__ float s_red[33];
  load_sequence(ws, &s_seq);
  __syncthreads();
  const Topology& t = use_islands ? ws.islands : ws.flat;
  const HierStep<T> step{ws, t, hier_slots(ws, t), parity_of(s_seq), s_seq};
  const int ppr = a.packs_per_row;

  for (int row = blockIdx.x; row < a.rows; row += gridDim.x) {
    for (int j = threadIdx.x; j < ppr; j += blockDim.x) {
      const long long g = static_cast<long long>(row) * ppr + j;
      step.scatter(g, remap_half_pack(a.inp[g]));
    }
  }
  for (int row = blockIdx.x; row < a.rows; row += gridDim.x) {
    for (int j = threadIdx.x; j < ppr; j += blockDim.x) {
      const long long g = static_cast<long long>(row) * ppr + j;
      if (step.owner(g) != t.my_index) continue;
      Acc8 acc = step.reduce_owned(g, remap_half_pack(a.inp[g]));
      accumulate<T>(acc, a.residual[g]);
      const uint4 r = remap_half_pack(round_pack<T>(acc));
      a.out[g] = r;
      step.gather_send(g, r);
    }
    float squares = 0.f;
    for (int j = threadIdx.x; j < ppr; j += blockDim.x) {
      const long long g = static_cast<long long>(row) * ppr + j;
      uint4 r;
      if (step.owner(g) == t.my_index) {
        r = a.out[g];  // our own store above, same thread
      } else {
        r = step.gather_receive(g);
        a.out[g] = r;
      }
      squares += sum_of_squares<T>(r);
    }
    const float inv_rms = rsqrtf(block_sum(squares, s_red) * a.inv_hidden + a.eps);
    for (int j = threadIdx.x; j < ppr; j += blockDim.x) {
      const long long g = static_cast<long long>(row) * ppr + j;
      a.norm_out[g] = scale_pack<T>(a.out[g], a.weight[j], inv_rms);
    }
  }
  finish_call(ws, s_seq);
}

int round_up_32(long long n) { return static_cast<int>(((n + 31) / 32) * 32); }

template <typename T>
cudaError_t launch_plain(const WorkspaceView& ws, Variant variant, const CallArgs& a, const LaunchShape& shape,
                         cudaStream_t stream) {
  const int threads = static_cast<int>(std::min<long long>(shape.threads, round_up_32(a.num_packs)));
  const long long wanted = (a.num_packs + threads - 1) / threads;
  const int blocks = static_cast<int>(std::max<long long>(1, std::min<long long>(wanted, shape.max_blocks)));
  if (variant == Variant::kOneShot) {
    oneshot_all_reduce_kernel<T><<<blocks, threads, 0, stream>>>(ws, a);
  } else {
    hier_all_reduce_kernel<T><<<blocks, threads, 0, stream>>>(ws, a, variant == Variant::kIsland);
  }
  return cudaGetLastError();
}

template <typename T>
cudaError_t launch_fused(const WorkspaceView& ws, Variant variant, const CallArgs& a, const LaunchShape& shape,
                         cudaStream_t stream) {
  const int threads = std::min(1024, round_up_32(a.packs_per_row));
  const int blocks = std::max(1, std::min(a.rows, shape.max_blocks));
  if (variant == Variant::kOneShot) {
    oneshot_add_rmsnorm_kernel<T><<<blocks, threads, 0, stream>>>(ws, a);
  } else {
    hier_add_rmsnorm_kernel<T><<<blocks, threads, 0, stream>>>(ws, a, variant == Variant::kIsland);
  }
  return cudaGetLastError();
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
