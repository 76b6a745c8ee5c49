// The all-reduce kernels: a one-shot push and a hierarchical (reduce-scatter, cross-island exchange,
// all-gather) push, each with a plain and a fused residual-add + RMSNorm epilogue.
// The protocol invariants (I1..I13) are stated in ar_protocol.cuh; comments below name the one they rely on.
#include <algorithm>
#include <type_traits>

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

// Fused kernels: a CTA per row. A row of up to 1024 packs (hidden <= 8192) gets one pack per thread of up to
// 1024 threads in one-shot, held in registers between the sum and the norm. Wider rows, and the hierarchical
// kernels, use 512-thread CTAs, where a thread has 128 registers rather than 64 (the waits at 8 ranks need
// them, see OneShotSlots::reduce_pack): up to kMaxPacksPerThread packs per thread, held when at most
// kHeldPacks, otherwise re-read from residual_out for the norm. Every fused kernel builds without spills
// (tests/test_build.py checks the cubins).
constexpr int kWideThreads = 512;
constexpr int kHeldPacks = 2;

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

  // Wait for every peer's pack g (all loads issued before any test, I10), empty the slots (I4), and sum in
  // rank order from bit-identical operands (I2), so every rank gets the same bits.
  // kBatch < kWorld waits for the ranks in groups of kBatch, adding each group before loading the next: one
  // more round trip per group, but 4 x kBatch registers of packs instead of 4 x kWorld, for the kernels that
  // would otherwise spill (see the kernels). The sum's order, and so its bits, does not depend on kBatch.
  template <typename T, int kBatch = kWorld>
  __device__ __forceinline__ Acc8 reduce_pack(const WorkspaceView& ws, unsigned long long seq, long long g,
                                              uint4 own) const {
    static_assert(kWorld % kBatch == 0, "batches must tile the ranks");
    const unsigned peers = ((1u << kWorld) - 1u) & ~(1u << ws.rank);
    Acc8 acc;
#pragma unroll
    for (int base = 0; base < kWorld; base += kBatch) {
      // v[rank - base] is never loaded: it is `own` from the start, so `own` needs no registers of its own
      // during the wait (at 8 ranks the wait holds 32 of the 64 registers a 1024-thread CTA leaves a thread).
      uint4 v[kBatch];
#pragma unroll
      for (int i = 0; i < kBatch; ++i) v[i] = own;
      const unsigned wanted = (peers >> base) & ((1u << kBatch) - 1u);
      auto addr = [&](int i) { return poll(ws, base + i, g); };
      wait_for_packs<kBatch, false>(ws, v, wanted, addr, [&](int i) { return base + i; }, kPhaseOneShot, seq);
      empty_packs<kBatch>(wanted, addr);
#pragma unroll
      for (int i = 0; i < kBatch; ++i) {
        if (base + i == 0) {
          acc = unpack<T>(v[i]);
        } else {
          accumulate<T>(acc, v[i]);
        }
      }
    }
    return acc;
  }

  // The polling this file had before I10, kept only for the polling microbenchmark (benchmarks/bench_polling.py,
  // one-shot bf16 at 8 ranks, see launch_oneshot_serial_poll) to time old against new in one build: each peer's
  // pack is loaded, waited on and tested before the next load issues (the self branch and the short-circuit
  // test serialise them).
  template <typename T>
  __device__ __forceinline__ Acc8 reduce_pack_serial(const WorkspaceView& ws, unsigned long long seq, long long g,
                                                     uint4 own) const {
    uint4 v[kWorld];
    bool pending = false;
#pragma unroll
    for (int p = 0; p < kWorld; ++p) {
      v[p] = p == ws.rank ? own : load_volatile(poll(ws, p, g));
      pending |= p != ws.rank && legacy_has_empty(v[p]);
    }
    if (pending) {
      const long long start = static_cast<long long>(global_timer_ns());
      unsigned int spins = 0;
      while (pending) {
        pending = false;
        int missing = -1;
#pragma unroll
        for (int p = 0; p < kWorld; ++p) {
          if (p != ws.rank && legacy_has_empty(v[p])) {
            v[p] = load_volatile(poll(ws, p, g));
            if (legacy_has_empty(v[p])) {
              pending = true;
              missing = p;
            }
          }
        }
        if (pending && (++spins & 255u) == 0u && wait_must_end(ws, start, missing, kPhaseOneShot, seq)) break;
      }
    }
#pragma unroll
    for (int p = 0; p < kWorld; ++p)
      if (p != ws.rank) store_volatile(poll(ws, p, g), empty_pack());
    Acc8 acc = unpack<T>(v[0]);
#pragma unroll
    for (int p = 1; p < kWorld; ++p) accumulate<T>(acc, v[p]);
    return acc;
  }

  static __device__ __forceinline__ bool legacy_has_empty(uint4 v) {
    auto half = [](uint32_t w) { return (w & 0xFFFFu) == kEmptyHalf || (w >> 16) == kEmptyHalf; };
    return half(v.x) || half(v.y) || half(v.z) || half(v.w);
  }

  template <typename T, bool kSerialPoll, int kBatch = kWorld>
  __device__ __forceinline__ Acc8 reduce(const WorkspaceView& ws, unsigned long long seq, long long g, uint4 own) const {
    if (kSerialPoll) return reduce_pack_serial<T>(ws, seq, g, own);
    return reduce_pack<T, kBatch>(ws, seq, g, own);
  }
};

template <typename T, int kWorld, bool kSerialPoll = false>
__global__ void __launch_bounds__(kPlainMaxThreads, 1) oneshot_all_reduce_kernel(const __grid_constant__ WorkspaceView ws, const __grid_constant__ CallArgs a) {
  if (begin_call(ws)) return;  // I12
  const unsigned long long seq = load_sequence(ws);
  const OneShotSlots<kWorld> slots(ws, parity_of(seq));
  const long long first = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
  const long long stride = static_cast<long long>(gridDim.x) * blockDim.x;

  // Push everything before waiting on anything: no wait below depends on a later push of our own.
  for (long long g = first; g < a.num_packs; g += stride) slots.push_pack(ws, g, remap_half_pack(a.inp[g]));
  for (long long g = first; g < a.num_packs; g += stride) {
    a.out[g] = round_pack<T>(slots.template reduce<T, kSerialPoll>(ws, seq, g, remap_half_pack(a.inp[g])));
  }
  finish_call(ws, seq);
}

// Fused: a CTA per row (rows few, hidden large), so the RMSNorm row sum is a block reduction; a thread's
// packs j = threadIdx.x + k * blockDim.x, k < kPacks.
// Registers: __launch_bounds__(1024) leaves 64 per thread, and one-shot's wait holds W packs (32 registers at
// 8 ranks). With one pack per thread (hidden <= 8192) the row's input and residual are loaded before the wait,
// and the rounded residual and the weight stay in registers for the norm. Wider rows run 512 threads with
// kPacks = kMaxPacksPerThread: each pack's operands are loaded when it is reduced, and the norm pass reads the
// residual back from residual_out (this thread's own store, so it sees it) and the weight again.
template <typename T, int kWorld, int kPacks, bool kSerialPoll = false>
__global__ void __launch_bounds__(kPacks == 1 ? 1024 : kWideThreads, 1) oneshot_add_rmsnorm_kernel(const __grid_constant__ WorkspaceView ws, const __grid_constant__ CallArgs a) {
  constexpr bool kHoldRow = kPacks == 1;
  constexpr int kUnroll = kHoldRow ? kPacks : 1;
  constexpr int kBatch = kWorld;
  __shared__ float s_red[33];
  if (begin_call(ws)) return;  // I12
  const unsigned long long seq = load_sequence(ws);
  const OneShotSlots<kWorld> slots(ws, parity_of(seq));
  const int ppr = a.packs_per_row;

  for (int row = blockIdx.x; row < a.rows; row += gridDim.x) {
#pragma unroll kUnroll
    for (int k = 0; k < kPacks; ++k) {
      const int j = threadIdx.x + k * blockDim.x;
      if (j < ppr) {
        const long long g = static_cast<long long>(row) * ppr + j;
        slots.push_pack(ws, g, remap_half_pack(a.inp[g]));
      }
    }
  }
  for (int row = blockIdx.x; row < a.rows; row += gridDim.x) {
    constexpr int kHeld = kHoldRow ? kPacks : 1;
    uint4 r[kHeld], w[kHeld], res[kHeld], own[kHeld];
    if (kHoldRow) {
#pragma unroll
      for (int k = 0; k < kHeld; ++k) {  // loads that do not depend on the peers go first
        const int j = threadIdx.x + k * blockDim.x;
        if (j < ppr) {
          const long long g = static_cast<long long>(row) * ppr + j;
          own[k] = remap_half_pack(a.inp[g]);
          res[k] = a.residual[g];
        }
      }
    }
    float squares = 0.f;
#pragma unroll kUnroll
    for (int k = 0; k < kPacks; ++k) {
      const int j = threadIdx.x + k * blockDim.x;
      if (j < ppr) {
        const long long g = static_cast<long long>(row) * ppr + j;
        const int h = kHoldRow ? k : 0;
        if (!kHoldRow) own[0] = remap_half_pack(a.inp[g]);
        Acc8 acc = slots.template reduce<T, kSerialPoll, kBatch>(ws, seq, g, own[h]);
        accumulate<T>(acc, kHoldRow ? res[h] : a.residual[g]);  // unheld: loaded after the wait
        r[h] = round_pack<T>(acc);  // residual_out, rounded once
        a.out[g] = r[h];
        // The weight is loaded only now: held across the wait it would push the 8-rank kernel past 64
        // registers; issued here its latency hides behind the row sum.
        if (kHoldRow) w[h] = a.weight[j];
        squares += sum_of_squares<T>(r[h]);  // the norm starts from the rounded residual, as SGLang's
      }
    }
    const float inv_rms = rsqrtf(block_sum(squares, s_red) * a.inv_hidden + a.eps);
#pragma unroll kUnroll
    for (int k = 0; k < kPacks; ++k) {
      const int j = threadIdx.x + k * blockDim.x;
      if (j < ppr) {
        const long long g = static_cast<long long>(row) * ppr + j;
        const uint4 x = kHoldRow ? r[k % kHeld] : a.out[g];
        const uint4 wt = kHoldRow ? w[k % kHeld] : a.weight[j];
        a.norm_out[g] = scale_pack<T>(x, wt, inv_rms);
      }
    }
  }
  finish_call(ws, seq);
}

// Fused one-shot with each row spread over a thread-block cluster of kCluster CTAs (issue 12): at a few rows
// the one-CTA-per-row kernel has only `rows` SMs pushing, polling and reducing a whole row each; here
// rows x kCluster SMs share the work. CTA c of a row's cluster owns the row's packs [c x per, (c+1) x per) with
// per = ceil(packs / kCluster), one per thread (blockDim = per rounded up to a warp, at most kWideThreads), so at
// hidden 7168 every CTA gets 112 packs rather than CTAs 0-6 getting 128 and CTA 7 none.
// The RMSNorm sum of squares: each CTA reduces its part (block_sum, fixed order),
// puts it in its shared memory, and after a cluster barrier every CTA adds the kCluster parts in CTA order
// from distributed shared memory, so all CTAs of the row, and every rank (same grid shape, same bits in),
// get the same bits. A second barrier (arrive after the reads, wait before the part is written again or the
// CTA exits) keeps a part alive until every CTA has read it.
// I8 holds per cluster: the host caps the number of clusters at what every GPU of the group can hold at once
// (cudaOccupancyMaxActiveClusters, agreed at construction) and at the SM budget, and rows beyond it loop.
// oneshot_add_rmsnorm_grouped_kernel below computes the same bits without a cluster (where cluster launch is
// unavailable).
__device__ __forceinline__ void cluster_arrive() { asm volatile("barrier.cluster.arrive.release.aligned;" ::: "memory"); }
__device__ __forceinline__ void cluster_wait() { asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory"); }
__device__ __forceinline__ unsigned cluster_cta_rank() {
  unsigned r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
  return r;
}
// Read a float at `local` in the shared memory of CTA `cta` of this cluster.
__device__ __forceinline__ float load_cluster_shared(const float* local, unsigned cta) {
  const unsigned addr = static_cast<unsigned>(__cvta_generic_to_shared(local));
  unsigned remote;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(addr), "r"(cta));
  float v;
  asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(v) : "r"(remote) : "memory");
  return v;
}

// Packs per CTA (or per group of the grouped kernel) when a row of `packs_per_row` is split `parts` ways.
__host__ __device__ __forceinline__ int packs_per_part(int packs_per_row, int parts) {
  return (packs_per_row + parts - 1) / parts;
}

template <typename T, int kWorld, int kCluster>
__global__ void __launch_bounds__(kWideThreads, 1) oneshot_add_rmsnorm_cluster_kernel(const __grid_constant__ WorkspaceView ws,
                                                                              const __grid_constant__ CallArgs a) {
  __shared__ float s_red[33];
  __shared__ float s_part;
  if (begin_call(ws)) return;  // I12
  const unsigned long long seq = load_sequence(ws);
  const OneShotSlots<kWorld> slots(ws, parity_of(seq));
  const int ppr = a.packs_per_row;
  const int per = packs_per_part(ppr, kCluster);
  const unsigned cta = cluster_cta_rank();
  const int j = static_cast<int>(cta) * per + static_cast<int>(threadIdx.x);
  const bool mine = static_cast<int>(threadIdx.x) < per && j < ppr;
  const int first_row = static_cast<int>(blockIdx.x / kCluster);
  const int row_stride = static_cast<int>(gridDim.x / kCluster);

  for (int row = first_row; row < a.rows; row += row_stride) {
    if (mine) {
      const long long g = static_cast<long long>(row) * ppr + j;
      slots.push_pack(ws, g, remap_half_pack(a.inp[g]));
    }
  }
  bool first = true;
  for (int row = first_row; row < a.rows; row += row_stride) {
    const long long g = static_cast<long long>(row) * ppr + j;
    uint4 r = make_uint4(0u, 0u, 0u, 0u), w = r;
    float squares = 0.f;
    if (mine) {
      const uint4 own = remap_half_pack(a.inp[g]);
      const uint4 res = a.residual[g];
      Acc8 acc = slots.template reduce_pack<T>(ws, seq, g, own);
      accumulate<T>(acc, res);
      r = round_pack<T>(acc);  // residual_out, rounded once
      a.out[g] = r;
      w = a.weight[j];
      squares = sum_of_squares<T>(r);
    }
    const float part = block_sum(squares, s_red);
    if (!first) cluster_wait();  // every CTA has read the previous row's part
    if (threadIdx.x == 0) s_part = part;
    cluster_arrive();
    cluster_wait();  // every part of this row is written
    float total = 0.f;
#pragma unroll
    for (int c = 0; c < kCluster; ++c) total += load_cluster_shared(&s_part, static_cast<unsigned>(c));
    cluster_arrive();  // done reading the parts
    first = false;
    const float inv_rms = rsqrtf(total * a.inv_hidden + a.eps);
    if (mine) a.norm_out[g] = scale_pack<T>(r, w, inv_rms);
  }
  if (!first) cluster_wait();  // no CTA exits while a peer CTA may still read its part
  finish_call(ws, seq);
}

// The sum over groups of kGroups x warps_per_group warps, bit for bit what the cluster kernel computes with one
// CTA of warps_per_group warps per group: block_sum's tree inside each group (lanes, then the group's warp sums
// by one warp, zeros beyond them), then the group sums added in group order from 0. `scratch` holds 32 +
// kGroups floats.
template <int kGroups>
__device__ __forceinline__ float grouped_sum(float v, float* scratch, int warps_per_group) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
  const int warp = threadIdx.x >> 5;
  const int lane = threadIdx.x & 31;
  __syncthreads();  // scratch may still be read by the previous row
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  if (warp < kGroups) {
    float t = lane < warps_per_group ? scratch[warp * warps_per_group + lane] : 0.f;
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) t += __shfl_xor_sync(0xffffffffu, t, offset);
    if (lane == 0) scratch[32 + warp] = t;
  }
  __syncthreads();
  float total = 0.f;
#pragma unroll
  for (int c = 0; c < kGroups; ++c) total += scratch[32 + c];
  return total;
}

// The fallback of the cluster kernel where cluster launch is unavailable or unproven (issue 22): one CTA per
// row of kGroups groups of blockDim / kGroups threads, group c laid out exactly as CTA c of a cluster (the same
// packs on the same lanes of the same warps), so residual_out and norm_out are the bits the cluster kernel
// gives: a box that cannot launch clusters computes what one that can does. Slower (`rows` SMs do the work of
// rows x kGroups), which is why it is only the fallback. 1024 threads: one pack per thread (packs <= 1024).
// At 8 ranks the wait loads the peers in two batches of 4 (one more round trip, the sum's order unchanged, see
// OneShotSlots::reduce_pack): a thread has 64 registers here, and all 8 at once would leave none to spare.
template <typename T, int kWorld, int kGroups>
__global__ void __launch_bounds__(1024, 1) oneshot_add_rmsnorm_grouped_kernel(const __grid_constant__ WorkspaceView ws,
                                                                              const __grid_constant__ CallArgs a) {
  constexpr int kBatch = kWorld > 4 ? 4 : kWorld;
  __shared__ float s_red[32 + kGroups];
  if (begin_call(ws)) return;  // I12
  const unsigned long long seq = load_sequence(ws);
  const OneShotSlots<kWorld> slots(ws, parity_of(seq));
  const int ppr = a.packs_per_row;
  const int per = packs_per_part(ppr, kGroups);
  const int group_threads = static_cast<int>(blockDim.x) / kGroups;
  const int group = static_cast<int>(threadIdx.x) / group_threads;
  const int i = static_cast<int>(threadIdx.x) - group * group_threads;
  const int j = group * per + i;
  const bool mine = i < per && j < ppr;

  for (int row = blockIdx.x; row < a.rows; row += gridDim.x) {
    if (mine) {
      const long long g = static_cast<long long>(row) * ppr + j;
      slots.push_pack(ws, g, remap_half_pack(a.inp[g]));
    }
  }
  for (int row = blockIdx.x; row < a.rows; row += gridDim.x) {
    const long long g = static_cast<long long>(row) * ppr + j;
    uint4 r = make_uint4(0u, 0u, 0u, 0u), w = r;
    float squares = 0.f;
    if (mine) {
      Acc8 acc = slots.template reduce_pack<T, kBatch>(ws, seq, g, remap_half_pack(a.inp[g]));
      accumulate<T>(acc, a.residual[g]);
      r = round_pack<T>(acc);  // residual_out, rounded once
      a.out[g] = r;
      w = a.weight[j];
      squares = sum_of_squares<T>(r);
    }
    const float total = grouped_sum<kGroups>(squares, s_red, group_threads >> 5);
    const float inv_rms = rsqrtf(total * a.inv_hidden + a.eps);
    if (mine) a.norm_out[g] = scale_pack<T>(r, w, inv_rms);
  }
  finish_call(ws, seq);
}

// ---------------------------------------------------------------------------------------------------------
// Hierarchical: packs are owned by island position in blocks of kOwnerBlockPacks consecutive packs, the
// blocks dealt round-robin (owner = (g / 32) % I), so each warp stores 512 B pieces per destination:
//  1. reduce-scatter: push each pack to its owner inside the island;
//  2. the owner sums its island's packs in position order (fp32); with several islands it swaps the fp32
//     partial with its twins (same position in the other islands) and sums the partials in island order, so
//     twins agree bit for bit; then it rounds once (adding its residual when fused);
//  3. all-gather: the owner pushes the result to its island.
// Bytes per rank with I ranks an island and G islands: 2 (I-1)/I x payload inside the island and
// 2 (G-1)/I x payload (fp32) across. Flat two-shot is G = 1.
// The fp32 partials cross islands as two planes (low 4 floats of every pack, then the high 4), so that link,
// the slowest, also gets 512 B pieces.
// Fused: the owner adds ITS residual. Tensor parallelism replicates the residual on every rank, so this is
// the caller's residual; the kernel does not check it.
// ---------------------------------------------------------------------------------------------------------

template <typename T, int kIsland>
struct HierStep {
  const WorkspaceView& ws;
  const Topology& t;
  int parity;
  unsigned long long seq;

  __device__ __forceinline__ HierStep(const WorkspaceView& w, const Topology& topo, unsigned long long s)
      : ws(w), t(topo), parity(parity_of(s)), seq(s) {}

  // Computed where used rather than kept: at 8 ranks the wait needs nearly every register (see reduce_pack).
  // cross-island slots: G x 2 planes of a chunk (fp32), after I reduce-scatter slots
  __device__ __forceinline__ long long xs_base() const { return static_cast<long long>(kIsland) * ws.chunk_slot_bytes; }
  // all-gather slots: I x chunk, after those
  __device__ __forceinline__ long long ag_base() const {
    return xs_base() + 2ll * t.num_islands * ws.chunk_slot_bytes;
  }

  __device__ __forceinline__ int owner(long long g) const {
    return static_cast<int>((g >> kOwnerBlockShift) & (kIsland - 1));
  }
  // Position of pack g inside its owner's chunk: the owner's blocks packed one after the other.
  __device__ __forceinline__ long long offset(long long g) const {
    return ((g / (kOwnerBlockPacks * kIsland)) << kOwnerBlockShift) | (g & (kOwnerBlockPacks - 1));
  }

  __device__ __forceinline__ char* rs_slot(int rank, int sender_pos, long long g) const {
    return region_of(ws, rank, parity) + sender_pos * ws.chunk_slot_bytes + offset(g) * kPackBytes;
  }
  // plane 0: floats 0..3 of the pack's partial, plane 1: floats 4..7
  __device__ __forceinline__ char* xs_slot(int rank, int sender_island, int plane, long long g) const {
    return region_of(ws, rank, parity) + xs_base() + (2ll * sender_island + plane) * ws.chunk_slot_bytes +
           offset(g) * kPackBytes;
  }
  __device__ __forceinline__ char* ag_slot(int rank, int sender_pos, long long g) const {
    return region_of(ws, rank, parity) + ag_base() + sender_pos * ws.chunk_slot_bytes + offset(g) * kPackBytes;
  }

  // Phase 1, by every rank for every pack it does not own.
  __device__ __forceinline__ void scatter(long long g, uint4 own) const {
    const int o = owner(g);
    if (o != t.my_index) store_volatile(rs_slot(t.island_ranks[o], t.my_index, g), own);
  }

  // Phase 2, by the owner: returns the fp32 sum over all ranks, identical on every twin.
  __device__ __forceinline__ Acc8 reduce_owned(long long g, uint4 own) const {
    // I10: the island's packs are loaded together, our own position being `own`, and summed in position
    // order. (kBatch as in OneShotSlots::reduce_pack; these kernels run at <= 512 threads, with the registers
    // for all 8.)
    constexpr int kBatch = kIsland;
    const unsigned senders = ((1u << kIsland) - 1u) & ~(1u << t.my_index);
    Acc8 part;
#pragma unroll
    for (int base = 0; base < kIsland; base += kBatch) {
      uint4 v[kBatch];
#pragma unroll
      for (int i = 0; i < kBatch; ++i) v[i] = own;  // v[my_index - base] is never loaded
      const unsigned wanted = (senders >> base) & ((1u << kBatch) - 1u);
      auto rs = [&](int i) { return rs_slot(ws.rank, base + i, g); };
      wait_for_packs<kBatch, false>(ws, v, wanted, rs, [&](int i) { return t.island_ranks[base + i]; },
                                    kPhaseReduceScatter, seq);
      empty_packs<kBatch>(wanted, rs);
#pragma unroll
      for (int i = 0; i < kBatch; ++i) {
        if (base + i == 0) {
          part = unpack<T>(v[i]);
        } else {
          accumulate<T>(part, v[i]);
        }
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
      store_volatile(xs_slot(t.twin_ranks[island], t.my_island, 0, g), lo);
      store_volatile(xs_slot(t.twin_ranks[island], t.my_island, 1, g), hi);
    }
    Acc8 total;
    for (int island = 0; island < t.num_islands; ++island) {
      Acc8 p;
      if (island == t.my_island) {
        p = partial_from(lo, hi);
      } else {
        // I10 within an island pair: both planes are loaded before either is tested.
        uint4 h[2];
        auto xs = [&](int plane) { return xs_slot(ws.rank, island, plane, g); };
        const int twin = t.twin_ranks[island];
        wait_for_packs<2, true>(ws, h, 3u, xs, [&](int) { return twin; }, kPhaseCrossIsland, seq);
        empty_packs<2>(3u, xs);
        p = partial_from(h[0], h[1]);
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
#pragma unroll
    for (int step = 1; step < kIsland; ++step) {
      const int pos = (t.my_index + step) & (kIsland - 1);
      store_volatile(ag_slot(t.island_ranks[pos], t.my_index, g), v);
    }
  }

  // Phase 3 (receive), by every rank for every pack it does not own.
  __device__ __forceinline__ uint4 gather_receive(long long g) const {
    const int o = owner(g);
    return consume_pack<false>(ws, ag_slot(ws.rank, o, g), t.island_ranks[o], kPhaseAllGather, seq);
  }
};

template <typename T, int kIsland>
__global__ void __launch_bounds__(kPlainMaxThreads, 1) hier_all_reduce_kernel(const __grid_constant__ WorkspaceView ws,
                                       const __grid_constant__ CallArgs a, bool use_islands) {
  if (begin_call(ws)) return;  // I12
  const Topology& t = use_islands ? ws.islands : ws.flat;
  const HierStep<T, kIsland> step(ws, t, load_sequence(ws));
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

// Registers as in oneshot_add_rmsnorm_kernel, at 512 threads: a row is held in registers up to kHeldPacks packs
// per thread; with more, the norm pass reads residual_out back (this thread wrote every pack of it it reads) and
// the weight.
template <typename T, int kIsland, int kPacks>
__global__ void __launch_bounds__(kWideThreads, 1) hier_add_rmsnorm_kernel(const __grid_constant__ WorkspaceView ws,
                                       const __grid_constant__ CallArgs a, bool use_islands) {
  constexpr bool kHoldRow = kPacks <= kHeldPacks;
  constexpr int kUnroll = kHoldRow ? kPacks : 1;
  constexpr int kHeld = kHoldRow ? kPacks : 1;
  __shared__ float s_red[33];
  if (begin_call(ws)) return;  // I12
  const Topology& t = use_islands ? ws.islands : ws.flat;
  const HierStep<T, kIsland> step(ws, t, load_sequence(ws));
  const int ppr = a.packs_per_row;

  for (int row = blockIdx.x; row < a.rows; row += gridDim.x) {
#pragma unroll kUnroll
    for (int k = 0; k < kPacks; ++k) {
      const int j = threadIdx.x + k * blockDim.x;
      if (j < ppr) {
        const long long g = static_cast<long long>(row) * ppr + j;
        step.scatter(g, remap_half_pack(a.inp[g]));
      }
    }
  }
  for (int row = blockIdx.x; row < a.rows; row += gridDim.x) {
    uint4 r[kHeld], w[kHeld];
#pragma unroll kUnroll
    for (int k = 0; k < kPacks; ++k) {
      const int j = threadIdx.x + k * blockDim.x;
      if (j < ppr) {
        const long long g = static_cast<long long>(row) * ppr + j;
        if (step.owner(g) != t.my_index) continue;
        Acc8 acc = step.reduce_owned(g, remap_half_pack(a.inp[g]));
        accumulate<T>(acc, a.residual[g]);
        const uint4 v = remap_half_pack(round_pack<T>(acc));  // as the peers will see it (I2)
        if (kHoldRow) r[k % kHeld] = v;
        a.out[g] = v;
        step.gather_send(g, v);
      }
    }
    float squares = 0.f;
#pragma unroll kUnroll
    for (int k = 0; k < kPacks; ++k) {
      const int j = threadIdx.x + k * blockDim.x;
      if (j < ppr) {
        const long long g = static_cast<long long>(row) * ppr + j;
        uint4 v;
        if (step.owner(g) != t.my_index) {
          v = step.gather_receive(g);
          a.out[g] = v;
        } else {
          v = kHoldRow ? r[k % kHeld] : a.out[g];
        }
        if (kHoldRow) {
          r[k % kHeld] = v;
          w[k % kHeld] = a.weight[j];  // loaded after the waits, as in the one-shot kernel
        }
        squares += sum_of_squares<T>(v);
      }
    }
    const float inv_rms = rsqrtf(block_sum(squares, s_red) * a.inv_hidden + a.eps);
#pragma unroll kUnroll
    for (int k = 0; k < kPacks; ++k) {
      const int j = threadIdx.x + k * blockDim.x;
      if (j < ppr) {
        const long long g = static_cast<long long>(row) * ppr + j;
        const uint4 x = kHoldRow ? r[k % kHeld] : a.out[g];
        const uint4 wt = kHoldRow ? w[k % kHeld] : a.weight[j];
        a.norm_out[g] = scale_pack<T>(x, wt, inv_rms);
      }
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
  const int threads = static_cast<int>(std::min<long long>(std::min(shape.threads, kPlainMaxThreads), round_up_32(a.num_packs)));
  const long long wanted = (a.num_packs + threads - 1) / threads;
  const int blocks = static_cast<int>(std::max<long long>(1, std::min<long long>(wanted, shape.max_blocks)));
  if (variant == Variant::kOneShotSerialPoll) {  // polling benchmark only: bf16, 8 ranks (only that is built)
    if constexpr (std::is_same<T, __nv_bfloat16>::value) {
      if (ws.world == 8) return launch_kernel(oneshot_all_reduce_kernel<T, 8, true>, blocks, threads, shape, stream, ws, a);
    }
    return cudaErrorInvalidValue;
  }
  if (variant != Variant::kOneShot) {
    const bool islands = variant == Variant::kIsland;
    switch ((islands ? ws.islands : ws.flat).island_size) {
      case 1: return launch_kernel(hier_all_reduce_kernel<T, 1>, blocks, threads, shape, stream, ws, a, islands);
      case 2: return launch_kernel(hier_all_reduce_kernel<T, 2>, blocks, threads, shape, stream, ws, a, islands);
      case 4: return launch_kernel(hier_all_reduce_kernel<T, 4>, blocks, threads, shape, stream, ws, a, islands);
      case 8: return launch_kernel(hier_all_reduce_kernel<T, 8>, blocks, threads, shape, stream, ws, a, islands);
      default: return cudaErrorInvalidValue;
    }
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
cudaError_t launch_oneshot_fused(const WorkspaceView& ws, const CallArgs& a, int blocks, int threads,
                                 const LaunchShape& shape, cudaStream_t stream) {
  switch (ws.world) {
    case 1: return launch_kernel(oneshot_add_rmsnorm_kernel<T, 1, kPacks>, blocks, threads, shape, stream, ws, a);
    case 2: return launch_kernel(oneshot_add_rmsnorm_kernel<T, 2, kPacks>, blocks, threads, shape, stream, ws, a);
    case 4: return launch_kernel(oneshot_add_rmsnorm_kernel<T, 4, kPacks>, blocks, threads, shape, stream, ws, a);
    case 8: return launch_kernel(oneshot_add_rmsnorm_kernel<T, 8, kPacks>, blocks, threads, shape, stream, ws, a);
    default: return cudaErrorInvalidValue;
  }
}

template <typename T, int kPacks>
cudaError_t launch_hier_fused(const WorkspaceView& ws, bool islands, const CallArgs& a, int blocks, int threads,
                              const LaunchShape& shape, cudaStream_t stream) {
  switch ((islands ? ws.islands : ws.flat).island_size) {
    case 1: return launch_kernel(hier_add_rmsnorm_kernel<T, 1, kPacks>, blocks, threads, shape, stream, ws, a, islands);
    case 2: return launch_kernel(hier_add_rmsnorm_kernel<T, 2, kPacks>, blocks, threads, shape, stream, ws, a, islands);
    case 4: return launch_kernel(hier_add_rmsnorm_kernel<T, 4, kPacks>, blocks, threads, shape, stream, ws, a, islands);
    case 8: return launch_kernel(hier_add_rmsnorm_kernel<T, 8, kPacks>, blocks, threads, shape, stream, ws, a, islands);
    default: return cudaErrorInvalidValue;
  }
}

// Cluster launch of the split fused kernel: grid = clusters x kCluster, clusters capped by I8 at what every GPU of the
// group can hold at once (shape.cluster_capacity, agreed at construction) and at the SM budget.
template <typename T, int kWorld, int kCluster>
cudaError_t launch_cluster_kernel(const WorkspaceView& ws, const CallArgs& a, int threads, const LaunchShape& shape,
                                  cudaStream_t stream) {
  cudaLaunchConfig_t config = {};
  config.blockDim = dim3(threads);
  config.stream = stream;
  cudaLaunchAttribute attribute[2];
  attribute[0].id = cudaLaunchAttributeClusterDimension;
  attribute[0].val.clusterDim.x = kCluster;
  attribute[0].val.clusterDim.y = 1;
  attribute[0].val.clusterDim.z = 1;
  attribute[1].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute[1].val.programmaticStreamSerializationAllowed = 1;
  config.attrs = attribute;
  config.numAttrs = shape.pdl ? 2 : 1;
  const int budget = std::min(shape.cluster_capacity[kCluster], shape.max_blocks / kCluster);
  if (budget < 1) return cudaErrorInvalidConfiguration;
  config.gridDim = dim3(std::min(a.rows, budget) * kCluster);
  return cudaLaunchKernelEx(&config, oneshot_add_rmsnorm_cluster_kernel<T, kWorld, kCluster>, ws, a);
}

template <typename T, int kCluster>
cudaError_t launch_cluster(const WorkspaceView& ws, const CallArgs& a, const LaunchShape& shape,
                           cudaStream_t stream) {
  const int threads = round_up_32(packs_per_part(a.packs_per_row, kCluster));
  switch (ws.world) {
    case 1: return launch_cluster_kernel<T, 1, kCluster>(ws, a, threads, shape, stream);
    case 2: return launch_cluster_kernel<T, 2, kCluster>(ws, a, threads, shape, stream);
    case 4: return launch_cluster_kernel<T, 4, kCluster>(ws, a, threads, shape, stream);
    case 8: return launch_cluster_kernel<T, 8, kCluster>(ws, a, threads, shape, stream);
    default: return cudaErrorInvalidValue;
  }
}

// The cluster kernel's bits without a cluster: one CTA per row (see oneshot_add_rmsnorm_grouped_kernel).
template <typename T, int kGroups>
cudaError_t launch_grouped(const WorkspaceView& ws, const CallArgs& a, const LaunchShape& shape, cudaStream_t stream) {
  const int threads = kGroups * round_up_32(packs_per_part(a.packs_per_row, kGroups));
  if (threads > 1024) return cudaErrorInvalidValue;
  const int blocks = std::max(1, std::min(a.rows, shape.max_blocks));
  switch (ws.world) {
    case 1: return launch_kernel(oneshot_add_rmsnorm_grouped_kernel<T, 1, kGroups>, blocks, threads, shape, stream, ws, a);
    case 2: return launch_kernel(oneshot_add_rmsnorm_grouped_kernel<T, 2, kGroups>, blocks, threads, shape, stream, ws, a);
    case 4: return launch_kernel(oneshot_add_rmsnorm_grouped_kernel<T, 4, kGroups>, blocks, threads, shape, stream, ws, a);
    case 8: return launch_kernel(oneshot_add_rmsnorm_grouped_kernel<T, 8, kGroups>, blocks, threads, shape, stream, ws, a);
    default: return cudaErrorInvalidValue;
  }
}

template <int kCluster>
cudaError_t cluster_capacity_of(int world, bool fp16, int threads, int* clusters) {
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(kCluster);
  config.blockDim = dim3(threads);
  cudaLaunchAttribute attribute[1];
  attribute[0].id = cudaLaunchAttributeClusterDimension;
  attribute[0].val.clusterDim.x = kCluster;
  attribute[0].val.clusterDim.y = 1;
  attribute[0].val.clusterDim.z = 1;
  config.attrs = attribute;
  config.numAttrs = 1;
  auto query = [&](auto kernel) { return cudaOccupancyMaxActiveClusters(clusters, kernel, &config); };
  switch (world) {
    case 1: return fp16 ? query(oneshot_add_rmsnorm_cluster_kernel<__half, 1, kCluster>)
                        : query(oneshot_add_rmsnorm_cluster_kernel<__nv_bfloat16, 1, kCluster>);
    case 2: return fp16 ? query(oneshot_add_rmsnorm_cluster_kernel<__half, 2, kCluster>)
                        : query(oneshot_add_rmsnorm_cluster_kernel<__nv_bfloat16, 2, kCluster>);
    case 4: return fp16 ? query(oneshot_add_rmsnorm_cluster_kernel<__half, 4, kCluster>)
                        : query(oneshot_add_rmsnorm_cluster_kernel<__nv_bfloat16, 4, kCluster>);
    case 8: return fp16 ? query(oneshot_add_rmsnorm_cluster_kernel<__half, 8, kCluster>)
                        : query(oneshot_add_rmsnorm_cluster_kernel<__nv_bfloat16, 8, kCluster>);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace

// Issue 12's rule, a pure function of group-identical values (so every rank launches the same grid shape):
// spread a row over 8, else 4 CTAs when every row's cluster fits the SM budget (rows x cluster <= sm_budget)
// and each CTA gets at least 2 warps of packs; otherwise one CTA per row. Rows wider than 8192 (more than one
// pack per thread at 1024 threads) keep the one-CTA kernels. From benchmarks/results/polling_h200_loopback.json
// (one H200, loopback, bf16 [rows, 7168]): 8 CTAs were the fastest wherever rows x 8 fit, 30-32% below one CTA
// per row at 8 ranks and 15-19% at 2 ranks for 1-16 rows; 2 CTAs at 64 rows were within 2% of one CTA (slower
// at 8 ranks), so the rule does not use 2; past the budget, rows loop and the split loses (4 or 8 at 64 rows:
// 1.4-2.4x slower).
int fused_cluster_size(int rows, int packs_per_row, int sm_budget) {
  if (packs_per_row > 1024) return 1;
  for (int c = 8; c >= 4; c /= 2)
    if (static_cast<long long>(rows) * c <= sm_budget && packs_per_row >= c * 64) return c;
  return 1;
}

// I8 for the cluster kernel, per cluster size: the clusters of kWideThreads-thread CTAs (the largest block the
// launch uses, so smaller ones fit as well) that `device` holds at once, for both element types (the smaller).
// 0 where the device cannot launch clusters at all (cudaDevAttrClusterLaunch).
cudaError_t query_cluster_capacity(int device, int world, int cluster, int* clusters) {
  *clusters = 0;
  int supported = 0;
  cudaError_t err = cudaDeviceGetAttribute(&supported, cudaDevAttrClusterLaunch, device);
  if (err != cudaSuccess || !supported) return err;
  int per_type[2] = {0, 0};
  for (int fp16 = 0; fp16 < 2; ++fp16) {
    switch (cluster) {
      case 2: err = cluster_capacity_of<2>(world, fp16, kWideThreads, &per_type[fp16]); break;
      case 4: err = cluster_capacity_of<4>(world, fp16, kWideThreads, &per_type[fp16]); break;
      case 8: err = cluster_capacity_of<8>(world, fp16, kWideThreads, &per_type[fp16]); break;
      default: return cudaErrorInvalidValue;
    }
    if (err != cudaSuccess) return err;
  }
  *clusters = std::min(per_type[0], per_type[1]);
  return cudaSuccess;
}

namespace {

template <typename T>
cudaError_t launch_fused(const WorkspaceView& ws, Variant variant, const CallArgs& a, const LaunchShape& shape,
                         cudaStream_t stream) {
  if (variant == Variant::kOneShot) {
    const int cluster = shape.cluster > 0 ? shape.cluster : fused_cluster_size(a.rows, a.packs_per_row, shape.max_blocks);
    if (cluster > 1 && a.packs_per_row > 1024) return cudaErrorInvalidValue;  // both layouts: a pack per thread
    // Where the group agreed that clusters of this size work (shape.cluster_mask), the cluster kernel; else the
    // same bits from one CTA per row.
    const bool clusters = ((shape.cluster_mask >> cluster) & 1) != 0;
    switch (cluster) {
      case 1: break;
      case 2: return clusters ? launch_cluster<T, 2>(ws, a, shape, stream) : launch_grouped<T, 2>(ws, a, shape, stream);
      case 4: return clusters ? launch_cluster<T, 4>(ws, a, shape, stream) : launch_grouped<T, 4>(ws, a, shape, stream);
      case 8: return clusters ? launch_cluster<T, 8>(ws, a, shape, stream) : launch_grouped<T, 8>(ws, a, shape, stream);
      default: return cudaErrorInvalidValue;
    }
  }
  const int blocks = std::max(1, std::min(a.rows, shape.max_blocks));
  if (a.packs_per_row > kMaxPacksPerThread * kWideThreads) return cudaErrorInvalidValue;  // the Python side
  // sends hidden > kMaxFusedHidden to the fallback
  const int wide_threads = std::min(kWideThreads, round_up_32(a.packs_per_row));
  const int wide_packs = (a.packs_per_row + wide_threads - 1) / wide_threads;
  if (variant == Variant::kOneShot || variant == Variant::kOneShotSerialPoll) {
    if (a.packs_per_row <= 1024) {
      const int threads = round_up_32(a.packs_per_row);
      if (variant == Variant::kOneShotSerialPoll) {  // polling benchmark only: bf16, 8 ranks (only that is built)
        if constexpr (std::is_same<T, __nv_bfloat16>::value) {
          if (ws.world == 8)
            return launch_kernel(oneshot_add_rmsnorm_kernel<T, 8, 1, true>, blocks, threads, shape, stream, ws, a);
        }
        return cudaErrorInvalidValue;
      }
      return launch_oneshot_fused<T, 1>(ws, a, blocks, threads, shape, stream);
    }
    if (variant == Variant::kOneShotSerialPoll) return cudaErrorInvalidValue;
    return launch_oneshot_fused<T, kMaxPacksPerThread>(ws, a, blocks, wide_threads, shape, stream);
  }
  const bool islands = variant == Variant::kIsland;
  if (wide_packs <= kHeldPacks) return launch_hier_fused<T, kHeldPacks>(ws, islands, a, blocks, wide_threads, shape, stream);
  return launch_hier_fused<T, kMaxPacksPerThread>(ws, islands, a, blocks, wide_threads, shape, stream);
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
