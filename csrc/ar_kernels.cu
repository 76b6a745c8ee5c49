// The all-reduce kernels: one-shot and hierarchical (reduce-scatter, cross-island exchange, all-gather)
// schedules, each with a plain and a fused residual-add + RMSNorm epilogue, over three transports: push
// (transports/push.cuh), staged push (transports/staged_push.cuh) and pull (transports/pull.cuh).
// The protocol invariants (I1..I13) are stated in ar_protocol.cuh, the transports' own (P1.., S1..) in their
// headers; comments below name the one they rely on.
#include <algorithm>
#include <type_traits>

#include "ar_launch.h"
#include "ar_protocol.cuh"
#include "pack_math.cuh"
#include "transports/pull.cuh"
#include "transports/push.cuh"
#include "transports/staged_push.cuh"

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
  int window;  // staged push: passes in flight before their pacing waits (transports/staged_push.cuh S3), >= 1
};

// Fused kernels (CTA sizes in ar_launch.h): a wide row's packs are held in registers from the sum to the norm when
// a thread has at most kHeldPacks of them, else re-read from residual_out. No fused kernel spills (tests/test_build.py).
constexpr int kHeldPacks = 2;
// Staged push: the packs a thread keeps in registers across its passes (S4) when it has no more than this many; with
// more it reads them from the input in every pass. Bounded so that no kernel spills (tests/test_build.py, ptxas 12.8
// included): the plain kernels have 128 registers a thread, the 1024-thread fused ones 64 (the grouped kernel, which
// keeps its group's indices too, spilled with 2 held packs under ptxas 12.8 at 8 ranks), the cluster kernel 128.
constexpr int kStagedHeldPlain = 4;
constexpr int kStagedHeldFused = 2;
constexpr int kStagedHeldGrouped = 1;

// The packs of one thread of a one-shot or hierarchical kernel, in the same order on every rank (P5): at(k) is the
// pack index of its k-th pack (k = 0, 1, ..), -1 past the last and from then on; value(g) is the remapped input.
// Called as a generator, packs(emit) calls emit(g, value) for each. With kHold > 0 (the staged passes call it once
// per pass, S4) a thread with at most kHold packs loads them once, all loads in flight together, and emits them
// from registers in every pass; a thread with more reads them from the input every time.
template <int kHold, typename At, typename Value>
struct ThreadPacks {
  At at;
  Value value;
  uint4 held[kHold > 0 ? kHold : 1];
  bool in_registers = false;

  __device__ __forceinline__ ThreadPacks(At a, Value v) : at(a), value(v) {
    if constexpr (kHold > 0) {
      in_registers = at(kHold) < 0;
      if (in_registers) {
#pragma unroll
        for (int k = 0; k < kHold; ++k) {
          const long long g = at(k);
          if (g >= 0) held[k] = value(g);
        }
      }
    }
  }

  template <typename Emit>
  __device__ __forceinline__ void operator()(Emit emit) const {
    if constexpr (kHold > 0) {
      if (in_registers) {
#pragma unroll
        for (int k = 0; k < kHold; ++k) {
          const long long g = at(k);
          if (g >= 0) emit(g, held[k]);
        }
        return;
      }
    }
    for (int k = 0;; ++k) {
      const long long g = at(k);
      if (g < 0) break;
      emit(g, value(g));
    }
  }
};

// kHold for transport kT: only the staged passes emit a thread's packs more than once.
template <int kT, int kBound, typename At, typename Value>
__device__ __forceinline__ auto thread_packs(At at, Value value) {
  return ThreadPacks<kT == kTransportStaged ? kBound : 0, At, Value>(at, value);
}

// One-shot over any transport: publish every own pack (push: into every peer's slot at once; staged: the same
// stores in permutation passes; pull: into our own pull area, then every peer's flag, then wait for theirs), then
// reduce pack by pack. `packs(emit)` calls emit(g, remapped pack) for every pack of this thread, in the same order
// on every rank (P5). All threads of the CTA call publish (staged and pull hold CTA barriers).
template <int kWorld, int kT>
struct OneShotPath {
  OneShotSlots<kWorld> slots;
  PullOneShot<kWorld> pull;
  unsigned long long seq;
  int window;  // staged: S3

  __device__ __forceinline__ OneShotPath(const WorkspaceView& ws, unsigned long long s, int w)
      : slots(ws, parity_of(s)), pull(s), seq(s), window(w) {}

  template <typename Packs>
  __device__ __forceinline__ void publish(const WorkspaceView& ws, Packs packs) const {
    if constexpr (kT == kTransportPush) {
      // Push everything before waiting on anything: no wait below depends on a later push of our own.
      packs([&](long long g, uint4 v) { slots.push_pack(ws, g, v); });
    } else if constexpr (kT == kTransportStaged) {
      staged_passes<kWorld - 1>(
          ws, seq, window, kFlagOneShot, kPhaseOneShot,
          [&](int p) {
            const int dest = (ws.rank + 1 + p) % kWorld;  // S2
            char* slot = region_of(ws, dest, slots.parity) + slots.push_offset;
            packs([&](long long g, uint4 v) { store_volatile(slot + g * kPackBytes, v); });
            return dest;
          },
          [&](int p) { return (ws.rank + kWorld - 1 - p) % kWorld; });
    } else {
      pull.publish_and_wait(ws, packs);  // P1, P2, P4
    }
  }

  // The fp32 sum of pack g over the ranks in rank order (bit for bit the same for every transport).
  template <typename T, int kBatch = kWorld>
  __device__ __forceinline__ Acc8 reduce(const WorkspaceView& ws, long long g, uint4 own) const {
    if constexpr (kT == kTransportPull) {
      return pull.template reduce_pack<T, kBatch>(ws, g, own);
    } else {
      return slots.template reduce_pack<T, kBatch>(ws, seq, g, own);
    }
  }
};

template <typename T, int kWorld, int kT>
__global__ void __launch_bounds__(kPlainMaxThreads, 1) oneshot_all_reduce_kernel(const __grid_constant__ WorkspaceView ws, const __grid_constant__ CallArgs a) {
  const long long first = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
  const long long stride = static_cast<long long>(gridDim.x) * blockDim.x;
  const CallStart start = begin_call(ws, first < a.num_packs ? a.inp + first : nullptr);
  if (start.poisoned) return;  // I12
  const unsigned long long seq = start.seq;
  const OneShotPath<kWorld, kT> path(ws, seq, a.window);

  path.publish(ws, thread_packs<kT, kStagedHeldPlain>(
                       [&](int k) {
                         const long long g = first + k * stride;
                         return g < a.num_packs ? g : -1ll;
                       },
                       [&](long long g) { return remap_half_pack(a.inp[g]); }));
  for (long long g = first; g < a.num_packs; g += stride) {
    a.out[g] = round_pack<T>(path.template reduce<T>(ws, g, remap_half_pack(a.inp[g])));
  }
  finish_call(ws, seq);
}

// The RMSNorm of row `row` of a fused kernel whose thread holds packs j = threadIdx.x + k * blockDim.x: final(k, g)
// returns pack g's residual_out, stored there by this thread (in final or before it). kHoldRow: the row's packs
// and weights stay in registers from the sum of squares to the scaling; otherwise the scaling reads residual_out
// back (this thread stored every pack of it that it reads) and the weight again. The weight is loaded only after
// final(): held across a wait it would push the 8-rank one-shot kernel past its 64 registers; issued there its
// latency hides behind the row sum.
template <typename T, int kPacks, bool kHoldRow, typename Final>
__device__ __forceinline__ void norm_row(const CallArgs& a, int row, float* s_red, Final final) {
  constexpr int kUnroll = kPacks <= kHeldPacks ? kPacks : 1;
  constexpr int kHeld = kHoldRow ? kPacks : 1;
  const int ppr = a.packs_per_row;
  uint4 r[kHeld], w[kHeld];
  float squares = 0.f;
#pragma unroll kUnroll
  for (int k = 0; k < kPacks; ++k) {
    const int j = threadIdx.x + k * blockDim.x;
    if (j < ppr) {
      const uint4 v = final(k, static_cast<long long>(row) * ppr + j);
      if (kHoldRow) {
        r[k % kHeld] = v;
        w[k % kHeld] = a.weight[j];
      }
      squares += sum_of_squares<T>(v);  // the norm starts from the rounded residual, as SGLang's
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

// Fused: a CTA per row (rows few, hidden large), so the RMSNorm row sum is a block reduction; a thread's
// packs j = threadIdx.x + k * blockDim.x, k < kPacks.
// Registers: __launch_bounds__(1024) leaves 64 per thread, and one-shot's wait holds W packs (32 registers at
// 8 ranks). With one pack per thread (hidden <= 8192) the row's input and residual are loaded before the wait,
// and the rounded residual and the weight stay in registers for the norm. Wider rows run 512 threads with
// kPacks = kMaxPacksPerThread: each pack's operands are loaded when it is reduced, and the norm pass reads the
// residual back from residual_out (this thread's own store, so it sees it) and the weight again.
template <typename T, int kWorld, int kPacks, int kT>
__global__ void __launch_bounds__(kPacks == 1 ? kFusedMaxThreads : kWideThreads, 1) oneshot_add_rmsnorm_kernel(const __grid_constant__ WorkspaceView ws, const __grid_constant__ CallArgs a) {
  constexpr bool kHoldRow = kPacks == 1;
  constexpr int kUnroll = kHoldRow ? kPacks : 1;
  // Push holds all 8 ranks' packs at once within the 1024-thread kernel's 64 registers; the staged passes and the
  // pull flags take a few more registers, so there the 8-rank wait goes in two batches (the sum's order, and so
  // its bits, unchanged).
  constexpr int kBatch = (kT == kTransportPush || !kHoldRow || kWorld <= 4) ? kWorld : 4;
  __shared__ float s_red[33];
  const int ppr = a.packs_per_row;
  const bool has_first = static_cast<int>(blockIdx.x) < a.rows && static_cast<int>(threadIdx.x) < ppr;
  const CallStart start =
      begin_call(ws, has_first ? a.inp + static_cast<long long>(blockIdx.x) * ppr + threadIdx.x : nullptr);
  if (start.poisoned) return;  // I12
  const unsigned long long seq = start.seq;
  const OneShotPath<kWorld, kT> path(ws, seq, a.window);

  auto input = [&](long long g) { return remap_half_pack(a.inp[g]); };
  if constexpr (kHoldRow) {  // a pack per row: the k-th is row blockIdx.x + k * gridDim.x's
    path.publish(ws, thread_packs<kT, kStagedHeldFused>(
                         [&](int k) {
                           const int row = static_cast<int>(blockIdx.x + k * gridDim.x);
                           const int j = static_cast<int>(threadIdx.x);
                           return row < a.rows && j < ppr ? static_cast<long long>(row) * ppr + j : -1ll;
                         },
                         input));
  } else {
    path.publish(ws, [&](auto emit) {
      for (int row = blockIdx.x; row < a.rows; row += gridDim.x) {
#pragma unroll kUnroll
        for (int k = 0; k < kPacks; ++k) {
          const int j = threadIdx.x + k * blockDim.x;
          if (j < ppr) {
            const long long g = static_cast<long long>(row) * ppr + j;
            emit(g, input(g));
          }
        }
      }
    });
  }
  for (int row = blockIdx.x; row < a.rows; row += gridDim.x) {
    constexpr int kHeld = kHoldRow ? kPacks : 1;
    uint4 res[kHeld], own[kHeld];
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
    norm_row<T, kPacks, kHoldRow>(a, row, s_red, [&](int k, long long g) {
      const int h = kHoldRow ? k : 0;
      if (!kHoldRow) own[0] = remap_half_pack(a.inp[g]);
      Acc8 acc = path.template reduce<T, kBatch>(ws, g, own[h]);
      accumulate<T>(acc, kHoldRow ? res[h] : a.residual[g]);  // unheld: loaded after the wait
      const uint4 r = round_pack<T>(acc);  // residual_out, rounded once
      a.out[g] = r;
      return r;
    });
  }
  finish_call(ws, seq);
}

// Fused one-shot with each row spread over a thread-block cluster of kCluster CTAs: at a few rows
// the one-CTA-per-row kernel has only `rows` SMs pushing, polling and reducing a whole row each; here
// rows x kCluster SMs share the work. CTA c of a row's cluster owns the row's packs [c x per, (c+1) x per) with
// per = ceil(packs / kCluster), one per thread (blockDim = per rounded up to a warp, at most kWideThreads), so at
// hidden 7168 every CTA gets 112 packs rather than CTAs 0-6 getting 128 and CTA 7 none.
// The RMSNorm sum of squares takes one cluster barrier per row:
//  C1  No CTA stores into another's shared memory before every CTA of the cluster has started: each arrives on the
//      cluster barrier right after begin_call and waits on it just before its first remote store (the row's
//      reduce lies between, so the wait costs nothing).
//  C2  Each warp's sum of squares (warp_sum: a fixed shuffle tree) is stored by lane c into CTA c's slot [row
//      parity][this CTA][warp] (st.shared::cluster), for every c; then one barrier.cluster arrive.release /
//      wait.acquire, after which every CTA holds every warp sum of the row in its own shared memory and adds them in
//      a fixed order (parts_in_order: each CTA's warps in order, then the CTAs in order). So every CTA of the row,
//      and every rank (the same grid, the same bits in), gets the same bits; the grouped kernel below computes them
//      too, one group per CTA.
//  C3  The slots are double-buffered by the parity of the row's turn in the CTA's loop: a CTA stores its sums of
//      turn i + 2 into a slot only after passing turn i + 1's barrier, which every CTA reaches only after reading
//      turn i's. No barrier at exit: after a CTA's last wait no CTA stores into its shared memory again (every
//      store precedes its CTA's arrive, which releases it), and it reads only its own.
// I8 holds per cluster: the host caps the number of clusters at what every GPU of the group can hold at once
// (cudaOccupancyMaxActiveClusters, agreed at construction) and at the SM budget, and rows beyond it loop.
// oneshot_add_rmsnorm_grouped_kernel below computes the same bits without a cluster (where cluster launch is
// unavailable).
constexpr int kMaxWarps = kWideThreads / 32;
__device__ __forceinline__ void cluster_arrive_relaxed() {
  asm volatile("barrier.cluster.arrive.relaxed.aligned;" ::: "memory");
}
__device__ __forceinline__ void cluster_arrive() { asm volatile("barrier.cluster.arrive.release.aligned;" ::: "memory"); }
__device__ __forceinline__ void cluster_wait() { asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory"); }
__device__ __forceinline__ unsigned cluster_cta_rank() {
  unsigned r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
  return r;
}
// Store a float at `local` in the shared memory of CTA `cta` of this cluster.
__device__ __forceinline__ void store_cluster_shared(float* local, unsigned cta, float v) {
  const unsigned addr = static_cast<unsigned>(__cvta_generic_to_shared(local));
  unsigned remote;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(addr), "r"(cta));
  asm volatile("st.shared::cluster.f32 [%0], %1;" ::"r"(remote), "f"(v) : "memory");
}

// The sum of one float per lane over the warp, the same bits on every lane and every rank (a fixed xor tree).
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

// The row's sum of squares from its warps' sums (C2): sums[c * stride + w] is warp w's sum in part c (a CTA of the
// cluster, a group of the grouped kernel), w < warps. Each part adds its warps in order, then the parts are added in
// order.
template <int kParts>
__device__ __forceinline__ float parts_in_order(const float* sums, int stride, int warps) {
  float total = 0.f;
#pragma unroll
  for (int c = 0; c < kParts; ++c) {
    float part = sums[c * stride];
    for (int w = 1; w < warps; ++w) part += sums[c * stride + w];
    total = c == 0 ? part : total + part;
  }
  return total;
}

// Packs per CTA (or per group of the grouped kernel) when a row of `packs_per_row` is split `parts` ways.
__host__ __device__ __forceinline__ int packs_per_part(int packs_per_row, int parts) {
  return (packs_per_row + parts - 1) / parts;
}

template <typename T, int kWorld, int kCluster, int kT>
__global__ void __launch_bounds__(kWideThreads, 1) oneshot_add_rmsnorm_cluster_kernel(const __grid_constant__ WorkspaceView ws,
                                                                              const __grid_constant__ CallArgs a) {
  __shared__ float s_sums[2][kCluster][kMaxWarps];  // C2, C3: [turn parity][CTA][warp]
  const int ppr = a.packs_per_row;
  const int per = packs_per_part(ppr, kCluster);
  const unsigned cta = cluster_cta_rank();
  const int j = static_cast<int>(cta) * per + static_cast<int>(threadIdx.x);
  const bool mine = static_cast<int>(threadIdx.x) < per && j < ppr;
  const int first_row = static_cast<int>(blockIdx.x / kCluster);  // every CTA of a cluster has the same rows
  const int row_stride = static_cast<int>(gridDim.x / kCluster);
  const CallStart start = begin_call(ws, mine ? a.inp + static_cast<long long>(first_row) * ppr + j : nullptr);
  if (start.poisoned) return;  // I12: the whole cluster returns, before any barrier
  cluster_arrive_relaxed();    // C1
  const unsigned long long seq = start.seq;
  const OneShotPath<kWorld, kT> path(ws, seq, a.window);
  const int warp = static_cast<int>(threadIdx.x) >> 5;
  const int lane = static_cast<int>(threadIdx.x) & 31;

  path.publish(ws, thread_packs<kT, kStagedHeldFused>(
                       [&](int k) {
                         const int row = first_row + k * row_stride;
                         return row < a.rows && mine ? static_cast<long long>(row) * ppr + j : -1ll;
                       },
                       [&](long long g) { return remap_half_pack(a.inp[g]); }));
  int parity = 0;
  for (int row = first_row; row < a.rows; row += row_stride) {
    const long long g = static_cast<long long>(row) * ppr + j;
    uint4 r = make_uint4(0u, 0u, 0u, 0u), w = r;
    float squares = 0.f;
    if (mine) {
      // Every load that does not depend on the peers before the wait, the weight included.
      const uint4 own = remap_half_pack(a.inp[g]);
      const uint4 res = a.residual[g];
      w = a.weight[j];
      Acc8 acc = path.template reduce<T>(ws, g, own);
      accumulate<T>(acc, res);
      r = round_pack<T>(acc);  // residual_out, rounded once (stored after the barrier: see below)
      squares = sum_of_squares<T>(r);
    }
    const float sum = warp_sum(squares);
    if (row == first_row) cluster_wait();  // C1
    if (lane < kCluster) store_cluster_shared(&s_sums[parity][cta][warp], static_cast<unsigned>(lane), sum);  // C2
    // The arrive's release waits for this thread's earlier stores to land; residual_out is not among them.
    cluster_arrive();
    cluster_wait();  // C2: every warp sum of this row is in our shared memory
    const float total = parts_in_order<kCluster>(&s_sums[parity][0][0], kMaxWarps, static_cast<int>(blockDim.x) >> 5);
    parity ^= 1;  // C3
    const float inv_rms = rsqrtf(total * a.inv_hidden + a.eps);
    if (mine) {
      a.out[g] = r;
      a.norm_out[g] = scale_pack<T>(r, w, inv_rms);
    }
  }
  finish_call(ws, seq);
}

// The fallback of the cluster kernel where cluster launch is unavailable or unproven: one CTA per
// row of kGroups groups of blockDim / kGroups threads, group c laid out exactly as CTA c of a cluster (the same
// packs on the same lanes of the same warps) and its warps' sums added as the cluster kernel adds them (C2,
// parts_in_order), so residual_out and norm_out are the bits the cluster kernel gives: a box that cannot launch
// clusters computes what one that can does. Slower (`rows` SMs do the work of rows x kGroups), which is why it is
// only the fallback. 1024 threads: one pack per thread (packs <= 1024). The warp sums are double-buffered by the
// row's turn (C3's argument, with the CTA barrier), so one barrier per row does.
// At 8 ranks the wait loads the peers in two batches of 4 (one more round trip, the sum's order unchanged, see
// OneShotSlots::reduce_pack): a thread has 64 registers here, and all 8 at once would leave none to spare; for the
// same reason the residual and the weight are loaded after the wait.
template <typename T, int kWorld, int kGroups, int kT>
__global__ void __launch_bounds__(kFusedMaxThreads, 1) oneshot_add_rmsnorm_grouped_kernel(const __grid_constant__ WorkspaceView ws,
                                                                              const __grid_constant__ CallArgs a) {
  constexpr int kBatch = kWorld > 4 ? 4 : kWorld;
  __shared__ float s_sums[2][32];  // [turn parity][warp]
  const int ppr = a.packs_per_row;
  const int per = packs_per_part(ppr, kGroups);
  const int group_threads = static_cast<int>(blockDim.x) / kGroups;
  const int group = static_cast<int>(threadIdx.x) / group_threads;
  const int i = static_cast<int>(threadIdx.x) - group * group_threads;
  const int j = group * per + i;
  const bool mine = i < per && j < ppr;
  const bool has_first = mine && static_cast<int>(blockIdx.x) < a.rows;
  const CallStart start = begin_call(ws, has_first ? a.inp + static_cast<long long>(blockIdx.x) * ppr + j : nullptr);
  if (start.poisoned) return;  // I12
  const unsigned long long seq = start.seq;
  const OneShotPath<kWorld, kT> path(ws, seq, a.window);

  path.publish(ws, thread_packs<kT, kStagedHeldGrouped>(
                       [&](int k) {
                         const int row = static_cast<int>(blockIdx.x + k * gridDim.x);
                         return row < a.rows && mine ? static_cast<long long>(row) * ppr + j : -1ll;
                       },
                       [&](long long g) { return remap_half_pack(a.inp[g]); }));
  int parity = 0;
  for (int row = blockIdx.x; row < a.rows; row += gridDim.x) {
    const long long g = static_cast<long long>(row) * ppr + j;
    uint4 r = make_uint4(0u, 0u, 0u, 0u), w = r;
    float squares = 0.f;
    if (mine) {
      Acc8 acc = path.template reduce<T, kBatch>(ws, g, remap_half_pack(a.inp[g]));
      accumulate<T>(acc, a.residual[g]);
      r = round_pack<T>(acc);  // residual_out, rounded once
      a.out[g] = r;
      w = a.weight[j];
      squares = sum_of_squares<T>(r);
    }
    const float sum = warp_sum(squares);
    if ((threadIdx.x & 31) == 0) s_sums[parity][threadIdx.x >> 5] = sum;
    __syncthreads();
    const int warps_per_group = group_threads >> 5;
    const float total = parts_in_order<kGroups>(&s_sums[parity][0], warps_per_group, warps_per_group);
    parity ^= 1;
    const float inv_rms = rsqrtf(total * a.inv_hidden + a.eps);
    if (mine) a.norm_out[g] = scale_pack<T>(r, w, inv_rms);
  }
  finish_call(ws, seq);
}

// Hierarchical over push or staged push (the same slots, HierStep): the reduce-scatter and the all-gather either
// store into every island peer at once (push) or in permutation passes (staged, S2); the cross-island exchange is
// one-to-one already and stays as it is.
template <typename T, int kIsland, int kT, typename Packs>
__device__ __forceinline__ void hier_scatter(const WorkspaceView& ws, const Topology& t, const HierStep<T, kIsland>& step,
                                             int window, Packs packs) {
  if constexpr (kT == kTransportPush) {
    packs([&](long long g, uint4 v) { step.scatter(g, v); });
  } else {
    staged_passes<kIsland - 1>(
        ws, step.seq, window, kFlagReduceScatter, kPhaseReduceScatter,
        [&](int p) {
          const int pos = (t.my_index + 1 + p) % kIsland;
          const int dest = t.island_ranks[pos];
          packs([&](long long g, uint4 v) {
            if (step.owner(g) == pos) store_volatile(step.rs_slot(dest, t.my_index, g), v);
          });
          return dest;
        },
        [&](int p) { return t.island_ranks[(t.my_index + kIsland - 1 - p) % kIsland]; });
  }
}

// Staged all-gather: the owned results (already in `out`, stored by this very thread) to the island, pass by pass.
template <typename T, int kIsland, typename Owned>
__device__ __forceinline__ void hier_staged_gather(const WorkspaceView& ws, const Topology& t,
                                                   const HierStep<T, kIsland>& step, int window, Owned owned) {
  staged_passes<kIsland - 1>(
      ws, step.seq, window, kFlagAllGather, kPhaseAllGather,
      [&](int p) {
        const int dest = t.island_ranks[(t.my_index + 1 + p) % kIsland];
        owned([&](long long g, uint4 v) { store_volatile(step.ag_slot(dest, t.my_index, g), v); });
        return dest;
      },
      [&](int p) { return t.island_ranks[(t.my_index + kIsland - 1 - p) % kIsland]; });
}

template <typename T, int kIsland, int kT>
__global__ void __launch_bounds__(kPlainMaxThreads, 1) hier_all_reduce_kernel(const __grid_constant__ WorkspaceView ws,
                                       const __grid_constant__ CallArgs a, bool use_islands) {
  const long long first_pack = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
  const CallStart start = begin_call(ws, first_pack < a.num_packs ? a.inp + first_pack : nullptr);
  if (start.poisoned) return;  // I12
  const Topology& t = use_islands ? ws.islands : ws.flat;
  const HierStep<T, kIsland> step(ws, t, start.seq);
  const long long first = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
  const long long stride = static_cast<long long>(gridDim.x) * blockDim.x;

  hier_scatter<T, kIsland, kT>(ws, t, step, a.window,
                               thread_packs<kT, kStagedHeldPlain>(
                                   [&](int k) {
                                     const long long g = first + k * stride;
                                     return g < a.num_packs ? g : -1ll;
                                   },
                                   [&](long long g) { return remap_half_pack(a.inp[g]); }));
  for (long long g = first; g < a.num_packs; g += stride) {
    if (step.owner(g) != t.my_index) continue;
    const uint4 v = remap_half_pack(round_pack<T>(step.reduce_owned(g, remap_half_pack(a.inp[g]))));
    a.out[g] = v;  // the remapped value, as the peers will see it (I2)
    if constexpr (kT == kTransportPush) step.gather_send(g, v);
  }
  if constexpr (kT == kTransportStaged) {
    hier_staged_gather<T, kIsland>(ws, t, step, a.window, [&](auto emit) {
      for (long long g = first; g < a.num_packs; g += stride)
        if (step.owner(g) == t.my_index) emit(g, a.out[g]);
    });
  }
  for (long long g = first; g < a.num_packs; g += stride) {
    if (step.owner(g) == t.my_index) continue;
    a.out[g] = step.gather_receive(g);
  }
  finish_call(ws, step.seq);
}

// Every pack of this thread in a hierarchical fused kernel, row by row: f(g, j), j the pack's index in its row.
template <int kPacks, typename F>
__device__ __forceinline__ void for_each_row_pack(const CallArgs& a, F f) {
  constexpr int kUnroll = kPacks <= kHeldPacks ? kPacks : 1;
  const int ppr = a.packs_per_row;
  for (int row = blockIdx.x; row < a.rows; row += gridDim.x) {
#pragma unroll kUnroll
    for (int k = 0; k < kPacks; ++k) {
      const int j = threadIdx.x + k * blockDim.x;
      if (j < ppr) f(static_cast<long long>(row) * ppr + j, j);
    }
  }
}

// Registers as in oneshot_add_rmsnorm_kernel, at 512 threads: a row is held in registers up to kHeldPacks packs
// per thread; with more, the norm pass reads residual_out back (this thread wrote every pack of it it reads) and
// the weight. Staged: the all-gather passes run once every row's owned packs are reduced, so the owned results
// are read back from residual_out too.
template <typename T, int kIsland, int kPacks, int kT>
__global__ void __launch_bounds__(kWideThreads, 1) hier_add_rmsnorm_kernel(const __grid_constant__ WorkspaceView ws,
                                       const __grid_constant__ CallArgs a, bool use_islands) {
  constexpr bool kHoldRow = kPacks <= kHeldPacks && kT == kTransportPush;
  constexpr int kUnroll = kPacks <= kHeldPacks ? kPacks : 1;
  constexpr int kHeld = kHoldRow ? kPacks : 1;
  __shared__ float s_red[33];
  const long long first_pack = static_cast<long long>(blockIdx.x) * a.packs_per_row + threadIdx.x;
  const bool has_first = static_cast<int>(blockIdx.x) < a.rows && static_cast<int>(threadIdx.x) < a.packs_per_row;
  const CallStart start = begin_call(ws, has_first ? a.inp + first_pack : nullptr);
  if (start.poisoned) return;  // I12
  const Topology& t = use_islands ? ws.islands : ws.flat;
  const HierStep<T, kIsland> step(ws, t, start.seq);
  const int ppr = a.packs_per_row;
  auto each_pack = [&](auto f) { for_each_row_pack<kPacks>(a, f); };

  hier_scatter<T, kIsland, kT>(ws, t, step, a.window, [&](auto emit) {
    each_pack([&](long long g, int) { emit(g, remap_half_pack(a.inp[g])); });
  });
  if constexpr (kT == kTransportStaged) {
    each_pack([&](long long g, int) {
      if (step.owner(g) != t.my_index) return;
      Acc8 acc = step.reduce_owned(g, remap_half_pack(a.inp[g]));
      accumulate<T>(acc, a.residual[g]);
      a.out[g] = remap_half_pack(round_pack<T>(acc));  // as the peers will see it (I2)
    });
    hier_staged_gather<T, kIsland>(ws, t, step, a.window, [&](auto emit) {
      each_pack([&](long long g, int) {
        if (step.owner(g) == t.my_index) emit(g, a.out[g]);
      });
    });
  }
  for (int row = blockIdx.x; row < a.rows; row += gridDim.x) {
    uint4 r[kHeld];
    if constexpr (kT == kTransportPush) {
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
    }
    norm_row<T, kPacks, kHoldRow>(a, row, s_red, [&](int k, long long g) {
      if (step.owner(g) != t.my_index) {
        const uint4 v = step.gather_receive(g);
        a.out[g] = v;
        return v;
      }
      if constexpr (kHoldRow) {
        return r[k % kHeld];
      } else {
        return a.out[g];
      }
    });
  }
  finish_call(ws, step.seq);
}

// Hierarchical over pull (transports/pull.cuh), phase by phase: every rank stores its input into its own pull area
// and the owners load their packs from the island (reduce-scatter); with several islands each owner stores its
// fp32 partial and the twins load each other's (cross-island); each owner stores its result and the island loads
// it (all-gather). The sums, their order and their rounding are push's (HierStep::reduce_owned), bit for bit.
template <typename T, int kIsland>
struct PullHierSteps {
  const WorkspaceView& ws;
  const Topology& t;
  const HierStep<T, kIsland>& step;
  PullHier<kIsland> pull;

  __device__ __forceinline__ PullHierSteps(const WorkspaceView& w, const Topology& topo, const HierStep<T, kIsland>& s)
      : ws(w), t(topo), step(s), pull(topo, s.seq) {}

  // Reduce-scatter: `packs(emit)` yields every pack of this thread (g, remapped input).
  template <typename Packs>
  __device__ __forceinline__ void scatter(Packs packs) const {
    pull.island_phase(ws, kFlagReduceScatter, kPhaseReduceScatter, [&]() {
      packs([&](long long g, uint4 v) { store_volatile(pull.input(ws, ws.rank, g), v); });  // P1
    });
  }

  // The island's fp32 sum of an owned pack, in position order; with islands, its two planes stored for the twins
  // (remapped as push sends them, I2, and kept so for our own use).
  __device__ __forceinline__ Acc8 island_part(long long g, uint4 own) const {
    return pull.template island_sum<T>(ws, g, own);
  }

  __device__ __forceinline__ void store_partial(long long g, const Acc8& part) const {
    store_volatile(pull.partial(ws, ws.rank, 0, step.offset(g)), remap_word_pack(partial_low(part)));
    store_volatile(pull.partial(ws, ws.rank, 1, step.offset(g)), remap_word_pack(partial_high(part)));
  }

  template <typename Stores>
  __device__ __forceinline__ void exchange_partials(Stores stores) const {
    pull.twin_phase(ws, stores);
  }

  // The total over islands in island order, from the stored planes (ours too, as push uses the remapped words).
  __device__ __forceinline__ Acc8 total(long long g) const {
    Acc8 sum;
    for (int island = 0; island < t.num_islands; ++island) {
      const int twin = t.twin_ranks[island];
      uint4 h[2];
      h[0] = load_volatile(pull.partial(ws, twin, 0, step.offset(g)));
      h[1] = load_volatile(pull.partial(ws, twin, 1, step.offset(g)));
      const Acc8 p = partial_from(h[0], h[1]);
      if (island == 0) {
        sum = p;
      } else {
#pragma unroll
        for (int i = 0; i < 8; ++i) sum.v[i] += p.v[i];
      }
    }
    return sum;
  }

  template <typename Stores>
  __device__ __forceinline__ void gather(Stores stores) const {
    pull.island_phase(ws, kFlagAllGather, kPhaseAllGather, stores);
  }

  __device__ __forceinline__ void store_result(long long g, uint4 v) const {
    store_volatile(pull.result(ws, ws.rank, step.offset(g)), v);  // P1
  }

  __device__ __forceinline__ uint4 load_result(long long g) const {
    return load_volatile(pull.result(ws, t.island_ranks[step.owner(g)], step.offset(g)));
  }
};

template <typename T, int kIsland>
__global__ void __launch_bounds__(kPlainMaxThreads, 1) hier_pull_all_reduce_kernel(const __grid_constant__ WorkspaceView ws,
                                       const __grid_constant__ CallArgs a, bool use_islands) {
  const long long first_pack = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
  const CallStart start = begin_call(ws, first_pack < a.num_packs ? a.inp + first_pack : nullptr);
  if (start.poisoned) return;  // I12
  const Topology& t = use_islands ? ws.islands : ws.flat;
  const HierStep<T, kIsland> step(ws, t, start.seq);
  const PullHierSteps<T, kIsland> pull(ws, t, step);
  const long long first = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
  const long long stride = static_cast<long long>(gridDim.x) * blockDim.x;
  auto owned = [&](auto f) {
    for (long long g = first; g < a.num_packs; g += stride)
      if (step.owner(g) == t.my_index) f(g);
  };

  pull.scatter([&](auto emit) {
    for (long long g = first; g < a.num_packs; g += stride) emit(g, remap_half_pack(a.inp[g]));
  });
  if (t.num_islands > 1) {
    pull.exchange_partials([&]() { owned([&](long long g) { pull.store_partial(g, pull.island_part(g, remap_half_pack(a.inp[g]))); }); });
    pull.gather([&]() {
      owned([&](long long g) {
        const uint4 v = remap_half_pack(round_pack<T>(pull.total(g)));
        a.out[g] = v;
        pull.store_result(g, v);
      });
    });
  } else {
    pull.gather([&]() {
      owned([&](long long g) {
        const uint4 v = remap_half_pack(round_pack<T>(pull.island_part(g, remap_half_pack(a.inp[g]))));
        a.out[g] = v;
        pull.store_result(g, v);
      });
    });
  }
  for (long long g = first; g < a.num_packs; g += stride)
    if (step.owner(g) != t.my_index) a.out[g] = pull.load_result(g);
  finish_call(ws, step.seq);
}

template <typename T, int kIsland, int kPacks>
__global__ void __launch_bounds__(kWideThreads, 1) hier_pull_add_rmsnorm_kernel(const __grid_constant__ WorkspaceView ws,
                                       const __grid_constant__ CallArgs a, bool use_islands) {
  __shared__ float s_red[33];
  const long long first_pack = static_cast<long long>(blockIdx.x) * a.packs_per_row + threadIdx.x;
  const bool has_first = static_cast<int>(blockIdx.x) < a.rows && static_cast<int>(threadIdx.x) < a.packs_per_row;
  const CallStart start = begin_call(ws, has_first ? a.inp + first_pack : nullptr);
  if (start.poisoned) return;  // I12
  const Topology& t = use_islands ? ws.islands : ws.flat;
  const HierStep<T, kIsland> step(ws, t, start.seq);
  const PullHierSteps<T, kIsland> pull(ws, t, step);
  auto each_pack = [&](auto f) { for_each_row_pack<kPacks>(a, f); };
  auto owned = [&](auto f) {
    each_pack([&](long long g, int) {
      if (step.owner(g) == t.my_index) f(g);
    });
  };
  // The owner adds its residual (replicated by tensor parallelism) to the total and rounds once (I2 remap).
  auto finish = [&](long long g, Acc8 acc) {
    accumulate<T>(acc, a.residual[g]);
    const uint4 v = remap_half_pack(round_pack<T>(acc));
    a.out[g] = v;
    pull.store_result(g, v);
  };

  pull.scatter([&](auto emit) { each_pack([&](long long g, int) { emit(g, remap_half_pack(a.inp[g])); }); });
  if (t.num_islands > 1) {
    pull.exchange_partials([&]() { owned([&](long long g) { pull.store_partial(g, pull.island_part(g, remap_half_pack(a.inp[g]))); }); });
    pull.gather([&]() { owned([&](long long g) { finish(g, pull.total(g)); }); });
  } else {
    pull.gather([&]() { owned([&](long long g) { finish(g, pull.island_part(g, remap_half_pack(a.inp[g]))); }); });
  }
  for (int row = blockIdx.x; row < a.rows; row += gridDim.x) {
    norm_row<T, kPacks, false>(a, row, s_red, [&](int, long long g) {
      if (step.owner(g) != t.my_index) {
        const uint4 v = pull.load_result(g);
        a.out[g] = v;
        return v;
      }
      return a.out[g];  // this thread's own store
    });
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

// The transport as a compile-time constant: f(std::integral_constant<int, kT>) for shape.transport.
template <typename F>
cudaError_t with_transport(int transport, F f) {
  switch (transport) {
    case kTransportPush: return f(std::integral_constant<int, kTransportPush>{});
    case kTransportStaged: return f(std::integral_constant<int, kTransportStaged>{});
    case kTransportPull: return f(std::integral_constant<int, kTransportPull>{});
    default: return cudaErrorInvalidValue;
  }
}

// The world size as a compile-time constant.
template <typename F>
cudaError_t with_world(int world, F f) {
  switch (world) {
    case 1: return f(std::integral_constant<int, 1>{});
    case 2: return f(std::integral_constant<int, 2>{});
    case 4: return f(std::integral_constant<int, 4>{});
    case 8: return f(std::integral_constant<int, 8>{});
    default: return cudaErrorInvalidValue;
  }
}

template <typename T>
cudaError_t launch_plain(const WorkspaceView& ws, Schedule schedule, const CallArgs& a, const LaunchShape& shape,
                         cudaStream_t stream) {
  const Grid grid = plain_grid(a.num_packs, shape.threads, shape.ctas);
  const int blocks = grid.blocks, threads = grid.threads;
  return with_transport(shape.transport, [&](auto transport) -> cudaError_t {
    constexpr int kT = decltype(transport)::value;
    if (schedule != Schedule::kOneShot) {
      const bool islands = schedule == Schedule::kIsland;
      return with_world((islands ? ws.islands : ws.flat).island_size, [&](auto island) -> cudaError_t {
        constexpr int kIsland = decltype(island)::value;
        if constexpr (kT == kTransportPull) {
          return launch_kernel(hier_pull_all_reduce_kernel<T, kIsland>, blocks, threads, shape, stream, ws, a, islands);
        } else {
          return launch_kernel(hier_all_reduce_kernel<T, kIsland, kT>, blocks, threads, shape, stream, ws, a, islands);
        }
      });
    }
    return with_world(ws.world, [&](auto world) {
      return launch_kernel(oneshot_all_reduce_kernel<T, decltype(world)::value, kT>, blocks, threads, shape, stream, ws,
                           a);
    });
  });
}

template <typename T, int kPacks>
cudaError_t launch_oneshot_fused(const WorkspaceView& ws, const CallArgs& a, int blocks, int threads,
                                 const LaunchShape& shape, cudaStream_t stream) {
  return with_transport(shape.transport, [&](auto transport) {
    return with_world(ws.world, [&](auto world) {
      return launch_kernel(oneshot_add_rmsnorm_kernel<T, decltype(world)::value, kPacks, decltype(transport)::value>,
                           blocks, threads, shape, stream, ws, a);
    });
  });
}

template <typename T, int kPacks>
cudaError_t launch_hier_fused(const WorkspaceView& ws, bool islands, const CallArgs& a, int blocks, int threads,
                              const LaunchShape& shape, cudaStream_t stream) {
  return with_transport(shape.transport, [&](auto transport) {
    constexpr int kT = decltype(transport)::value;
    return with_world((islands ? ws.islands : ws.flat).island_size, [&](auto island) -> cudaError_t {
      constexpr int kIsland = decltype(island)::value;
      if constexpr (kT == kTransportPull) {
        return launch_kernel(hier_pull_add_rmsnorm_kernel<T, kIsland, kPacks>, blocks, threads, shape, stream, ws, a,
                             islands);
      } else {
        return launch_kernel(hier_add_rmsnorm_kernel<T, kIsland, kPacks, kT>, blocks, threads, shape, stream, ws, a,
                             islands);
      }
    });
  });
}

// Cluster launch of the split fused kernel: grid = clusters x kCluster, clusters capped by I8 at what every GPU of the
// group can hold at once (shape.cluster_capacity, agreed at construction) and at the SM budget.
template <typename T, int kWorld, int kCluster, int kT>
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
  const int blocks = fused_cluster_grid(a.rows, kCluster, shape.ctas, shape.cluster_capacity[kCluster]);
  if (blocks < 1) return cudaErrorInvalidConfiguration;
  config.gridDim = dim3(blocks);
  return cudaLaunchKernelEx(&config, oneshot_add_rmsnorm_cluster_kernel<T, kWorld, kCluster, kT>, ws, a);
}

template <typename T, int kCluster>
cudaError_t launch_cluster(const WorkspaceView& ws, const CallArgs& a, const LaunchShape& shape,
                           cudaStream_t stream) {
  const int threads = round_up_warp(packs_per_part(a.packs_per_row, kCluster));
  return with_transport(shape.transport, [&](auto transport) {
    return with_world(ws.world, [&](auto world) {
      return launch_cluster_kernel<T, decltype(world)::value, kCluster, decltype(transport)::value>(ws, a, threads,
                                                                                                   shape, stream);
    });
  });
}

// The cluster kernel's bits without a cluster: one CTA per row (see oneshot_add_rmsnorm_grouped_kernel).
template <typename T, int kGroups>
cudaError_t launch_grouped(const WorkspaceView& ws, const CallArgs& a, const LaunchShape& shape, cudaStream_t stream) {
  const int threads = kGroups * round_up_warp(packs_per_part(a.packs_per_row, kGroups));
  if (threads > kFusedMaxThreads) return cudaErrorInvalidValue;
  const int blocks = fused_row_grid(a.rows, shape.ctas);
  return with_transport(shape.transport, [&](auto transport) {
    return with_world(ws.world, [&](auto world) {
      return launch_kernel(oneshot_add_rmsnorm_grouped_kernel<T, decltype(world)::value, kGroups,
                                                              decltype(transport)::value>,
                           blocks, threads, shape, stream, ws, a);
    });
  });
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
    case 1: return fp16 ? query(oneshot_add_rmsnorm_cluster_kernel<__half, 1, kCluster, kTransportPush>)
                        : query(oneshot_add_rmsnorm_cluster_kernel<__nv_bfloat16, 1, kCluster, kTransportPush>);
    case 2: return fp16 ? query(oneshot_add_rmsnorm_cluster_kernel<__half, 2, kCluster, kTransportPush>)
                        : query(oneshot_add_rmsnorm_cluster_kernel<__nv_bfloat16, 2, kCluster, kTransportPush>);
    case 4: return fp16 ? query(oneshot_add_rmsnorm_cluster_kernel<__half, 4, kCluster, kTransportPush>)
                        : query(oneshot_add_rmsnorm_cluster_kernel<__nv_bfloat16, 4, kCluster, kTransportPush>);
    case 8: return fp16 ? query(oneshot_add_rmsnorm_cluster_kernel<__half, 8, kCluster, kTransportPush>)
                        : query(oneshot_add_rmsnorm_cluster_kernel<__nv_bfloat16, 8, kCluster, kTransportPush>);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace

// The fused one-shot's CTAs per row, a pure function of group-identical values (so every rank launches the same
// grid shape): the largest of 8, 4, 2 whose clusters all run in one wave, every row's cluster within the call's
// CTA cap (rows x c <= ctas) and, where the cluster kernel launches (capacity[c] > 0, I8), rows <= the clusters of
// c CTAs the group holds at once, and each CTA gets at least 2 warps of packs; otherwise one CTA per row. Rows
// wider than kMaxClusterRowPacks keep the one-CTA kernels. Past either bound rows loop over the clusters and the
// split loses. The transport enters through the cap: staged push may run on few CTAs. The sweeps behind the rule
// are in docs/design.md.
int fused_cluster_size(int rows, int packs_per_row, int ctas, const int* capacity) {
  if (packs_per_row > kMaxClusterRowPacks) return 1;
  for (int c = 8; c >= 2; c /= 2) {
    const bool one_wave = static_cast<long long>(rows) * c <= ctas &&
                          (capacity == nullptr || capacity[c] <= 0 || rows <= capacity[c]);
    if (one_wave && packs_per_row >= c * 64) return c;
  }
  return 1;
}

// The largest CTA of a cluster launch of `cluster` CTAs: a row of at most kMaxClusterRowPacks packs split that many
// ways, a pack per thread (512, 256, 128 threads for 2, 4, 8).
constexpr int cluster_block_threads(int cluster) { return round_up_warp(kMaxClusterRowPacks / cluster); }

// I8 for the cluster kernel, per cluster size: the clusters of the largest CTAs that size launches
// (cluster_block_threads; smaller ones fit as well) that `device` holds at once, for both element types (the
// smaller). Queried at that size rather than at kWideThreads: at 8 ranks a 512-thread CTA takes a whole SM's
// registers, so fewer than 16 clusters of 8 fit on an H200, where 128-thread CTAs let several share an SM.
// 0 where the device cannot launch clusters at all (cudaDevAttrClusterLaunch).
cudaError_t query_cluster_capacity(int device, int world, int cluster, int* clusters) {
  *clusters = 0;
  int supported = 0;
  cudaError_t err = cudaDeviceGetAttribute(&supported, cudaDevAttrClusterLaunch, device);
  if (err != cudaSuccess || !supported) return err;
  int per_type[2] = {0, 0};
  for (int fp16 = 0; fp16 < 2; ++fp16) {
    switch (cluster) {
      case 2: err = cluster_capacity_of<2>(world, fp16, cluster_block_threads(2), &per_type[fp16]); break;
      case 4: err = cluster_capacity_of<4>(world, fp16, cluster_block_threads(4), &per_type[fp16]); break;
      case 8: err = cluster_capacity_of<8>(world, fp16, cluster_block_threads(8), &per_type[fp16]); break;
      default: return cudaErrorInvalidValue;
    }
    if (err != cudaSuccess) return err;
  }
  *clusters = std::min(per_type[0], per_type[1]);
  return cudaSuccess;
}

namespace {

template <typename T>
cudaError_t launch_fused(const WorkspaceView& ws, Schedule schedule, const CallArgs& a, const LaunchShape& shape,
                         cudaStream_t stream) {
  if (schedule == Schedule::kOneShot) {
    const int cluster = shape.cluster > 0 ? shape.cluster
                                          : fused_cluster_size(a.rows, a.packs_per_row, shape.ctas,
                                                               shape.cluster_capacity);
    if (cluster > 1 && a.packs_per_row > kMaxClusterRowPacks) return cudaErrorInvalidValue;  // a pack per thread
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
  const int blocks = fused_row_grid(a.rows, shape.ctas);
  if (a.packs_per_row > kMaxPacksPerThread * kWideThreads) return cudaErrorInvalidValue;  // the op refuses it first
  const int wide_threads = std::min(kWideThreads, round_up_warp(a.packs_per_row));
  const int wide_packs = (a.packs_per_row + wide_threads - 1) / wide_threads;
  if (schedule == Schedule::kOneShot) {
    if (a.packs_per_row <= kFusedMaxThreads)
      return launch_oneshot_fused<T, 1>(ws, a, blocks, round_up_warp(a.packs_per_row), shape, stream);
    return launch_oneshot_fused<T, kMaxPacksPerThread>(ws, a, blocks, wide_threads, shape, stream);
  }
  const bool islands = schedule == Schedule::kIsland;
  if (wide_packs <= kHeldPacks) return launch_hier_fused<T, kHeldPacks>(ws, islands, a, blocks, wide_threads, shape, stream);
  return launch_hier_fused<T, kMaxPacksPerThread>(ws, islands, a, blocks, wide_threads, shape, stream);
}

}  // namespace

cudaError_t launch_all_reduce(const WorkspaceView& ws, Schedule schedule, ElemType type, const void* inp, void* out,
                              long long numel, const LaunchShape& shape, cudaStream_t stream) {
  CallArgs a{};
  a.inp = static_cast<const uint4*>(inp);
  a.out = static_cast<uint4*>(out);
  a.num_packs = numel / kElemsPerPack;
  a.window = shape.window > 0 ? shape.window : kDefaultStagedWindow;
  if (type == ElemType::kBFloat16) return launch_plain<__nv_bfloat16>(ws, schedule, a, shape, stream);
  return launch_plain<__half>(ws, schedule, a, shape, stream);
}

cudaError_t launch_all_reduce_add_rmsnorm(const WorkspaceView& ws, Schedule schedule, ElemType type, const void* inp,
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
  a.window = shape.window > 0 ? shape.window : kDefaultStagedWindow;
  a.eps = eps;
  a.inv_hidden = 1.0f / static_cast<float>(hidden);
  if (type == ElemType::kBFloat16) return launch_fused<__nv_bfloat16>(ws, schedule, a, shape, stream);
  return launch_fused<__half>(ws, schedule, a, shape, stream);
}

}  // namespace sgl_sm120
