// The push transport (ar_protocol.cuh I1-I13): every rank stores its packs straight into its peers' scratch, and
// readiness travels in the data. OneShotSlots for the one-shot schedule, HierStep for the hierarchical ones; the
// staged and pull transports (staged_push.cuh, pull.cuh) build on the same slots.
#pragma once

#include "../ar_protocol.cuh"
#include "../pack_math.cuh"

namespace sgl_sm120 {
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
      add_in_source_order<T>(acc, v, base);
    }
    return acc;
  }
};

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
      add_in_source_order<T>(part, v, base);
    }
    if (t.num_islands == 1) return part;
    // I2 for fp32 words: use the remapped partial ourselves too.
    const uint4 lo = remap_word_pack(partial_low(part));
    const uint4 hi = remap_word_pack(partial_high(part));
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

}  // namespace sgl_sm120
