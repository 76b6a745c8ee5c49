// The pull transport. On many PCIe fabrics the all-to-all posted writes of push collapse (several GPUs
// behind one switch writing to several root complexes), while peer loads keep their speed (docs/design.md,
// "Three transports"). So here every rank stores its packs into its OWN slab, publishes readiness with one
// small remote store per consumer, and the consumers load the packs from there. Nobody polls peer memory: a rank
// spins on its own flags only.
//
// Invariants (each relied on by the code below, which names it):
//  P1  A producer stores its packs, remapped as push remaps them (I2), into its own pull area of the call's
//      parity (I5), each where every consumer computes it to be: at the pack index g for inputs, at offset(g) in
//      the owner's chunk for partials and results.
//  P2  Publication follows the data: the CTA passes a barrier after its stores, then one thread per consumer stores
//      the call counter seq + 1, with release semantics at system scope, into that consumer's flag for (phase,
//      this rank, this CTA index). No thread fences on its own: a release is cumulative, it orders before the flag
//      every store that precedes it in causality order, and the barrier puts every store of the CTA there (the PTX
//      memory model; the pattern of a grid barrier). SGL_SM120_DEBUG_FLAG_BEFORE_DATA breaks this on purpose (the
//      flags go out before the stores): consumers then read stale packs, and the tests must see it.
//  P3  Flags are counters, one word per parity of the call (ar_types.h, flag_index): the word of (parity, phase,
//      source, CTA) holds seq + 1 of the latest call of that parity its source published in that phase, and "call s
//      is there" is exactly: the word of parity s & 1 EQUALS s + 1. Exact, because no later call can have written
//      it: a rank ends call s + 1 only after every peer has begun it (every output of an all-reduce needs every
//      input), so while we are in call s a source is at most in call s + 1, which writes the other parity's word,
//      and its next call of our parity, s + 2, needs our call s + 1. The word holds s + 1 or an earlier call's
//      counter (s - 1, s - 3, .., 0). One word for both parities would not do: the source's call s + 1 may replace
//      s + 1 by s + 2 before we load it (it needs only our flag of call s, published before we wait), and
//      equality would then wait forever. Any other value (a peer CTA that skipped the call, a peer launching
//      another grid, P5, a stale or foreign word) never reads as ready: the wait ends in the timeout record naming
//      this call (I7), never in another call's data. (A rank that skips a whole call and goes on presents, in its
//      next call, the counter of the one it skipped: the device counts a rank's own calls; only the host can tell.)
//      No flag is ever reset, and the transports of different calls of one workspace share a phase's words.
//  P4  A consumer loads a producer's packs only after one of its threads saw the producer's flag and then issued an
//      acquire fence (system scope), and the CTA passed a barrier since. The polls themselves are relaxed loads:
//      a relaxed load that reads the released value followed by an acquire fence is an acquire (PTX memory model),
//      and the fence runs once per wait rather than at every poll. The waits are bounded and reported like every
//      wait (I7, I9).
//  P5  Pack g is produced and consumed by the same CTA index on every rank: the grid and the pack -> CTA mapping
//      are the same everywhere (the group agrees the launch limits, Workspace::limits), so one flag per CTA
//      says that every pack that CTA's consumers need is there.
//  P6  Every CTA publishes to, and waits for, every peer of a phase in every call, whether or not it has packs
//      for that peer. So in call s + 1 a producer has seen each consumer's flag of call s + 1, which the consumer
//      published only after its call s, and with it every read of call s, had ended: when the producer stores
//      into the same parity again in call s + 2 (I5), nobody reads it any more.
//  P7  A consumer issues its loads of a pack from every peer of a batch before it uses any (I10's reason), each
//      into registers of its own, in rotated order (from rank + 1 on, within the batch) so the consumers do not
//      all start on one slab; only then does it undo the rotation (fixed moves of registers, load_rotated) and
//      sum in rank order (add_in_source_order, push's loop): bit for bit what push gives (the same operands, P1,
//      in the same order). tests/test_pull_peer_loads.py checks in the built SASS that a batch's loads are all
//      issued before any is used.
#pragma once

#include "../ar_protocol.cuh"
#include "../pack_math.cuh"

namespace sgl_sm120 {

// P2 and P4 for the peers a phase talks to. `peer_of(i)` is the rank of peer i (i < count); the thread with index i
// publishes to it and waits for it, so blockDim.x >= count (every launch has at least 32 threads).
struct PullSignals {
  unsigned long long seq;

  template <typename PeerOf>
  __device__ __forceinline__ void publish(const WorkspaceView& ws, int flag_phase, int count, PeerOf peer_of) const {
#ifndef SGL_SM120_DEBUG_FLAG_BEFORE_DATA
    __syncthreads();  // P2: every store of the CTA before the releases below
#endif
    const int i = static_cast<int>(threadIdx.x);
    if (i < count) {
      const int peer = peer_of(i);
      if (peer != ws.rank)
        store_flag_release(flag_of(ws, peer, flag_phase, ws.rank, blockIdx.x, seq), seq + 1ull);  // P3
    }
  }

  template <typename PeerOf>
  __device__ __forceinline__ void wait(const WorkspaceView& ws, int flag_phase, int report_phase, int count,
                                       PeerOf peer_of) const {
    const int i = static_cast<int>(threadIdx.x);
    if (i < count) {
      const int peer = peer_of(i);
      if (peer != ws.rank)
        wait_for_flag<true>(ws, flag_of(ws, ws.rank, flag_phase, peer, blockIdx.x, seq), seq + 1ull, peer,
                            report_phase, seq);  // P3: equal to this call's counter
    }
    __syncthreads();  // P4: the whole CTA may load now
  }
};

// The packs of sources base .. base + kBatch - 1 into v[i] = source base + i, ours (index `self`) being `own` (P7).
// Every load is issued before any is used, each into registers of its own: x[s], s a compile-time index, is
// source base + ((self + 1 + s) mod kBatch), so the consumers do not all start on one slab and ours, where it is
// in this batch, comes last. A run-time index into x[] would put it in local memory, and choosing each load's
// place as it returns makes every load wait for the one before it. So the rotation is undone only once all are
// issued, by log2(kBatch) fixed rotations of the array, each taken or not by one bit of the shift (the same on
// every thread). kBatch is a power of two (the world and island sizes are).
template <int kCount, int kBatch, typename Addr>
__device__ __forceinline__ void load_rotated(uint4 (&v)[kBatch], int base, int self, uint4 own, Addr addr) {
  static_assert(kBatch > 0 && (kBatch & (kBatch - 1)) == 0 && kCount % kBatch == 0, "batches of 2^k tile sources");
  constexpr int kMask = kBatch - 1;
  const int shift = (self + 1) & kMask;
  const bool own_batch = kBatch == kCount || (self & ~kMask) == base;  // a single batch always holds ours
  uint4 x[kBatch];
#pragma unroll
  for (int s = 0; s < kBatch; ++s) {
    if (s == kMask && own_batch) {
      x[s] = own;
    } else {
      x[s] = load_volatile(addr(base + ((s + shift) & kMask)));
    }
  }
#pragma unroll
  for (int bit = 1; bit < kBatch; bit <<= 1) {
    if (shift & bit) {
      uint4 y[kBatch];
#pragma unroll
      for (int i = 0; i < kBatch; ++i) y[i] = x[(i - bit) & kMask];
#pragma unroll
      for (int i = 0; i < kBatch; ++i) x[i] = y[i];
    }
  }
#pragma unroll
  for (int i = 0; i < kBatch; ++i) v[i] = x[i];
}

// The fp32 sum over sources 0 .. kCount - 1 in order (P7), loaded in batches of kBatch: one more round trip per
// batch, kBatch packs of registers instead of kCount (for the 64-register kernels); the order, and so the bits,
// does not depend on kBatch (as OneShotSlots::reduce_pack).
template <typename T, int kCount, int kBatch, typename Addr>
__device__ __forceinline__ Acc8 sum_rotated(int self, uint4 own, Addr addr) {
  Acc8 acc;
#pragma unroll
  for (int base = 0; base < kCount; base += kBatch) {
    uint4 v[kBatch];
    load_rotated<kCount, kBatch>(v, base, self, own, addr);
    add_in_source_order<T>(acc, v, base);
  }
  return acc;
}

// One-shot pull: every rank's input copy sits at pack index g of its pull area; every rank loads every peer's.
template <int kWorld>
struct PullOneShot {
  int parity;
  PullSignals signals;

  __device__ __forceinline__ explicit PullOneShot(unsigned long long seq) : parity(parity_of(seq)), signals{seq} {}

  // P1, then P2 and P4 for every peer: `packs(emit)` calls emit(g, remapped pack) for every pack of this thread.
  template <typename Packs>
  __device__ __forceinline__ void publish_and_wait(const WorkspaceView& ws, Packs packs) const {
    auto everyone = [](int i) { return i; };
#ifdef SGL_SM120_DEBUG_FLAG_BEFORE_DATA
    signals.publish(ws, kFlagOneShot, kWorld, everyone);  // P2 broken on purpose
#endif
    char* mine = pull_area_of(ws, ws.rank, parity);
    packs([&](long long g, uint4 v) { store_volatile(mine + g * kPackBytes, v); });
#ifndef SGL_SM120_DEBUG_FLAG_BEFORE_DATA
    signals.publish(ws, kFlagOneShot, kWorld, everyone);
#endif
    signals.wait(ws, kFlagOneShot, kPhaseOneShot, kWorld, everyone);
  }

  template <typename T, int kBatch = kWorld>
  __device__ __forceinline__ Acc8 reduce_pack(const WorkspaceView& ws, long long g, uint4 own) const {
    return sum_rotated<T, kWorld, kBatch>(ws.rank, own,
                                          [&](int peer) { return pull_area_of(ws, peer, parity) + g * kPackBytes; });
  }
};

// Hierarchical pull, phase by phase (the owner layout is HierStep's: owner(g), offset(g)):
//  reduce-scatter: every rank's input copy at pack index g; each owner loads its island's copies of its packs;
//  cross-island: each owner's fp32 partial (two planes, as push sends them) at offset(g); twins load each other's;
//  all-gather: each owner's result at offset(g); the island loads it from the owner.
// Every phase ends with P2/P4 among the ranks it involves, so a CTA goes through the phases in step with its peers.
template <int kIsland>
struct PullHier {
  const Topology& t;
  int parity;
  PullSignals signals;

  __device__ __forceinline__ PullHier(const Topology& topo, unsigned long long seq)
      : t(topo), parity(parity_of(seq)), signals{seq} {}

  __device__ __forceinline__ char* input(const WorkspaceView& ws, int rank, long long g) const {
    return pull_area_of(ws, rank, parity) + g * kPackBytes;
  }
  __device__ __forceinline__ char* partial(const WorkspaceView& ws, int rank, int plane, long long at) const {
    return pull_area_of(ws, rank, parity) + ws.pull_input_bytes + (plane * ws.chunk_slot_bytes) + at * kPackBytes;
  }
  __device__ __forceinline__ char* result(const WorkspaceView& ws, int rank, long long at) const {
    return pull_area_of(ws, rank, parity) + ws.pull_input_bytes + 2 * ws.chunk_slot_bytes + at * kPackBytes;
  }

  template <typename Stores>
  __device__ __forceinline__ void island_phase(const WorkspaceView& ws, int flag_phase, int report_phase,
                                               Stores stores) const {
    auto island = [&](int i) { return t.island_ranks[i]; };
#ifdef SGL_SM120_DEBUG_FLAG_BEFORE_DATA
    signals.publish(ws, flag_phase, kIsland, island);
#endif
    stores();
#ifndef SGL_SM120_DEBUG_FLAG_BEFORE_DATA
    signals.publish(ws, flag_phase, kIsland, island);
#endif
    signals.wait(ws, flag_phase, report_phase, kIsland, island);
  }

  template <typename Stores>
  __device__ __forceinline__ void twin_phase(const WorkspaceView& ws, Stores stores) const {
    auto twins = [&](int i) { return t.twin_ranks[i]; };
#ifdef SGL_SM120_DEBUG_FLAG_BEFORE_DATA
    signals.publish(ws, kFlagCrossIsland, t.num_islands, twins);
#endif
    stores();
#ifndef SGL_SM120_DEBUG_FLAG_BEFORE_DATA
    signals.publish(ws, kFlagCrossIsland, t.num_islands, twins);
#endif
    signals.wait(ws, kFlagCrossIsland, kPhaseCrossIsland, t.num_islands, twins);
  }

  // The island's sum of pack g in position order (P7), from the island's input copies; `own` is ours.
  template <typename T>
  __device__ __forceinline__ Acc8 island_sum(const WorkspaceView& ws, long long g, uint4 own) const {
    return sum_rotated<T, kIsland, kIsland>(t.my_index, own,
                                            [&](int pos) { return input(ws, t.island_ranks[pos], g); });
  }
};

}  // namespace sgl_sm120
