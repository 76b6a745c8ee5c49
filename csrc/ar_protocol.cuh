// The protocol shared by every all-reduce variant and transport: workspace layout, readiness carried in the data
// (sentinel half-words, push and staged push), bounded spin-waits (on packs and on flags), the device-side call
// sequence, and the timeout report. The transports add their own invariants in transports/pull.cuh (P1-P7) and
// transports/staged_push.cuh (S1-S3).
//
// Protocol invariants (each one is relied on by code in ar_kernels.cu and transports/; the line that relies on it
// says so):
//
//  I1  Scratch is "empty" when every 16-bit half-word holds kEmptyHalf (0x8000, the bit pattern of -0.0 in
//      bf16 and fp16). The host fills the whole slab with it once, at creation, and never again.
//  I2  A producer never writes kEmptyHalf: it remaps a real -0.0 to +0.0 before the store (remap_half_pack).
//      fp32 partials are written as 32-bit words and never equal kEmptyWord (remap_word_pack maps that one
//      denormal pattern, -2^-134, to -0.0; sums of bf16/fp16 inputs cannot produce it).
//      Because the remap changes what peers see, the producer also uses the remapped value itself, so every
//      rank reduces bit-identical operands.
//  I3  A consumer treats a 16-byte pack as ready only when none of its half-words (or, for fp32 packs, none
//      of its words) is empty. Each lane is checked on its own, so a pack that lands in pieces is not read
//      early. This tolerates tearing down to 32-bit words and no further: it rests on every v4 access being
//      STRONG.SYS (volatile), whose four 32-bit elements are each single-copy atomic, and on PCIe (and NVLink)
//      carrying whole aligned 32-bit words, so a half-word never arrives one byte at a time.
//  I4  Every consumed pack is written back to empty by its consumer, in the same kernel. So when a call
//      ends on every rank, all scratch it used is empty again, whatever variant or size the next call has.
//  I5  Scratch is double-buffered by the parity of the call sequence number `seq`, which lives in device
//      memory (one copy per CTA index, see Ctrl) and is advanced by the kernel at the end of each call
//      (never by the host, so a captured graph replays correctly). A rank in call s writes into parity s&1 of its peers. A peer can still be in call s-1
//      (reading parity (s-1)&1, a different buffer) but not in call s-2: our call s-1 needed that peer's
//      pushes of call s-1, which it issues only after its call s-2 has completed (I6). So the
//      buffer we write was emptied (I4) by a kernel that has finished.
//  I6  A rank's calls on one workspace are totally ordered, in the order the host issues them: seq (I5) is read at
//      a kernel's entry and advanced at its exit, so two calls running at once would take the same seq. The host
//      keeps it where a call is made (workspace_enter_stream and the rule, stream_step, in ar_launch.h; applied in
//      workspace.cu), at the cost of one comparison: a call from the stream of the previous eager call goes on.
//      Any other call takes the slow path, which asks CUDA whether the streams involved are capturing a graph:
//        eager, from another stream: it is ordered after everything issued so far on the previous eager stream (an
//          event recorded there, waited for here), so an alternate or overlap stream is safe, never a hang. SGLang's
//          own changes (its eager warm-ups on a capture stream after a device synchronize, then serving on its
//          forward stream) are ordered already; the event costs them one record and one wait, once. Refused, with
//          one error on every rank since every rank issues the same calls, when the previous eager stream is
//          capturing a graph right then: nothing recorded there could be waited for outside its capture.
//        captured: it runs when the graph is replayed, so it needs no order against eager calls now. Inside one
//          capture a call from another stream than the previous captured one is ordered after it (an event edge
//          in the graph); and captured calls keep the slow path until the next eager call, so each is checked.
//      What no call shows: replays. A graph replays on the stream it is launched on, so the caller keeps replays
//      and eager calls on one stream order (SGLang replays and serves eager calls on its forward stream), and
//      replays no two graphs of one workspace at once. SGL_SM120_DEBUG_NO_STREAM_ORDER drops the event edges on
//      purpose: calls from two streams then overtake each other (tests/gpu/test_negative_controls.py);
//      tests/stream_order_check.cu walks SGLang's sequences of streams through the rule on the host.
//  I7  Every spin-wait is bounded (timeout_ns). On expiry the first waiting thread of the rank claims the
//      report, records rank, peer, phase, seq and the time waited in host-mapped memory, and marks the workspace
//      poisoned (Ctrl::poisoned). What follows depends on view.trap_on_timeout:
//        trap: every expired thread traps (the others first wait for the record, bounded, 10 ms), so the process
//              gets a CUDA error and no kernel of the context runs again: no wrong result can flow on.
//        exit: the threads give up instead. Every other wait of the call sees the poison at its next bound check
//              (every 256 polls, below) and gives up too, so the call ends within microseconds with garbage in
//              its outputs, and I12 makes every later call a no-op. The CUDA context stays usable; the host
//              raises IpcAllReduceTimeoutError from the record (synchronize(), and every later call). With
//              several processes time-slicing one GPU a trap may not reach every process (docs/design.md), so
//              tests and the tuner use exit mode there.
//  I8  A pack is produced and consumed by the same (CTA index, thread index) on every rank, and all CTAs of
//      a launch are co-resident (grid <= SM count; cluster launches also <= the clusters the GPU can hold at
//      once), so no CTA waits on a peer CTA that cannot be scheduled.
//  I9  A late peer is not a dead one: a wait longer than warn_ns (seconds) is reported once per call, without
//      trapping, in host-mapped memory (rank, peer, phase, seq, time waited), and the host logs it; only
//      timeout_ns (minutes by default) ends in I7. Times are signed differences of %globaltimer, so a timer
//      that steps backwards reads as no wait rather than as an instant timeout.
//  I10 A consumer issues the loads of every pack it needs for one output pack before it tests any of them
//      (wait_for_packs): on PCIe each test that has to wait for its load before the next load is issued
//      adds a round trip, 7 of them per pack at 8 ranks. Only the packs still empty are loaded again.
//  I11 With the workspace in host memory (view.host_memory, no P2P), a consumer's emptying stores (I4) travel
//      over PCIe like the pushes (a third crossing per byte: push, poll, empty), and nothing orders them before
//      a later call's pushes of this rank except a system-scope fence. So every thread fences (system scope)
//      after its last emptying store and before the call ends; I5's argument then holds again: a peer writes
//      into a slot only after it has seen our push of the following call, which we issue after the fence.
//      (One release fence by one thread after a CTA barrier would be cheaper; no GPU run has judged it yet.)
//  I12 A poisoned workspace (I7, exit mode) does nothing: every kernel reads Ctrl::poisoned right after
//      pdl_wait (all threads, before any barrier, so the early return is uniform over the CTA and the cluster:
//      the flag is only written inside a call, and calls are stream-ordered, I6) and returns without a push,
//      a wait or a store to its outputs. Its seq slot and its first input pack are read in the same breath
//      (begin_call): reads change nothing, and the call's first stores then wait for one memory round trip,
//      not for two in a row.
//  I13 Host-memory polls back off: after a miss, a thread sleeps (__nanosleep, 256 ns doubling to 1 us)
//      before it loads again, so hundreds of threads polling host memory do not fill PCIe with reads that
//      mostly find nothing. Device-memory polls hit the local L2 and spin without sleeping.
#pragma once

#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "ar_types.h"

namespace sgl_sm120 {

__device__ __forceinline__ uint4 load_volatile(const void* p) {
  uint4 v;
  asm volatile("ld.volatile.global.v4.u32 {%0,%1,%2,%3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p)
               : "memory");
  return v;
}

__device__ __forceinline__ void store_volatile(void* p, uint4 v) {
  asm volatile("st.volatile.global.v4.u32 [%0], {%1,%2,%3,%4};" ::"l"(p), "r"(v.x), "r"(v.y), "r"(v.z),
               "r"(v.w)
               : "memory");
}

__device__ __forceinline__ unsigned long long global_timer_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// I3 for packs of 16-bit elements: a per-half-word compare or-ed over the pack, no short-circuit, so testing
// several packs does not chain their loads through branches (I10).
__device__ __forceinline__ bool half_pack_has_empty(uint4 v) {
  return (__vcmpeq2(v.x, kEmptyWord) | __vcmpeq2(v.y, kEmptyWord) | __vcmpeq2(v.z, kEmptyWord) |
          __vcmpeq2(v.w, kEmptyWord)) != 0u;
}

// I3 for packs of fp32 partials (bitwise, as above).
__device__ __forceinline__ bool word_pack_has_empty(uint4 v) {
  return ((v.x == kEmptyWord) | (v.y == kEmptyWord) | (v.z == kEmptyWord) | (v.w == kEmptyWord)) != 0;
}

template <bool kWordPack>
__device__ __forceinline__ bool pack_has_empty(uint4 v) {
  return kWordPack ? word_pack_has_empty(v) : half_pack_has_empty(v);
}

__device__ __forceinline__ uint32_t remap_half_word(uint32_t w) {
  uint32_t lo = w & 0xFFFFu;
  uint32_t hi = w >> 16;
  lo = lo == kEmptyHalf ? 0u : lo;
  hi = hi == kEmptyHalf ? 0u : hi;
  return lo | (hi << 16);
}

// I2: -0.0 -> +0.0 so that no real value reads as empty.
__device__ __forceinline__ uint4 remap_half_pack(uint4 v) {
  return make_uint4(remap_half_word(v.x), remap_half_word(v.y), remap_half_word(v.z), remap_half_word(v.w));
}

__device__ __forceinline__ uint32_t remap_word(uint32_t w) { return w == kEmptyWord ? 0x80000000u : w; }

// I2 for a pack of fp32 words (a plane of a partial, pack_math.cuh partial_low / partial_high).
__device__ __forceinline__ uint4 remap_word_pack(uint4 v) {
  return make_uint4(remap_word(v.x), remap_word(v.y), remap_word(v.z), remap_word(v.w));
}

__device__ __forceinline__ uint4 empty_pack() { return make_uint4(kEmptyWord, kEmptyWord, kEmptyWord, kEmptyWord); }

// I7: record the first timeout of this rank where the host can read it and poison the workspace, then trap or
// give up (view.trap_on_timeout). static: this header is included by more than one translation unit.
// Every thread waiting for the same peer expires within the same few polls, so several get here at once: the one
// that claims the report writes it. In trap mode the others must not trap before it has (a trap ends the whole
// context, and the host would then find no record, only an unnamed "unspecified launch failure"), so they wait for
// the flag, bounded (10 ms), then trap.
__device__ __forceinline__ void report_timeout(const WorkspaceView& ws, int peer, int phase, unsigned long long seq,
                                               unsigned long long waited) {
  volatile ErrorRecord* rec = ws.error;
  if (atomicCAS(&ws.ctrl->report_claim, 0u, 1u) == 0u) {
    rec->rank = ws.rank;
    rec->peer = peer;
    rec->phase = phase;
    rec->seq = static_cast<long long>(seq);
    rec->waited_ns = static_cast<long long>(waited);
    __threadfence_system();
    rec->flag = 1;
    *reinterpret_cast<volatile unsigned int*>(&ws.ctrl->poisoned) = 1u;
    __threadfence_system();
  } else if (ws.trap_on_timeout) {
    const long long start = static_cast<long long>(global_timer_ns());
    while (rec->flag == 0 && static_cast<long long>(global_timer_ns()) - start < 10ll * 1000 * 1000) {
    }
  }
  if (ws.trap_on_timeout) __trap();
}

__device__ __forceinline__ bool workspace_poisoned(const WorkspaceView& ws) {
  return *reinterpret_cast<volatile unsigned int*>(&ws.ctrl->poisoned) != 0u;
}

// I9: report that this call has waited `waited` ns for `peer`, once per call across all threads of the rank.
// Every thread past warn_ns comes here every 256 polls (keeping a per-thread "reported" flag would cost a
// register in every spin loop, fused kernels included); the plain read keeps the atomic off that slow path.
__device__ __forceinline__ void report_slow_wait(const WorkspaceView& ws, int peer, int phase, unsigned long long seq,
                                              long long waited) {
  if (*reinterpret_cast<volatile unsigned long long*>(&ws.ctrl->slow_reported) >= seq + 1ull) return;
  if (atomicMax(&ws.ctrl->slow_reported, seq + 1ull) < seq + 1ull) {
    volatile SlowRecord* rec = ws.slow;
    rec->rank = ws.rank;
    rec->peer = peer;
    rec->phase = phase;
    rec->waited_ns = waited;
    __threadfence_system();
    rec->call_plus_one = static_cast<long long>(seq + 1ull);
    __threadfence_system();
  }
}

// Called every 256 polls of a spin-wait that started at `start`: true when the wait must give up (I7: the workspace
// is poisoned, by this thread's own timeout or by another's); else I9 (report once per call, go on).
__device__ __forceinline__ bool wait_must_end(const WorkspaceView& ws, long long start, int peer, int phase,
                                              unsigned long long seq) {
  if (workspace_poisoned(ws)) return true;
  const long long waited = static_cast<long long>(global_timer_ns()) - start;
  if (waited > ws.warn_ns) {
    if (waited > ws.timeout_ns) {
      report_timeout(ws, peer, phase, seq, static_cast<unsigned long long>(waited));
      return true;
    }
    report_slow_wait(ws, peer, phase, seq, waited);
  }
  return false;
}

// I13: the pause after the n-th miss (n >= 1) of a host-memory poll; device-memory polls do not pause.
__device__ __forceinline__ void poll_backoff(const WorkspaceView& ws, unsigned int misses) {
  if (ws.host_memory) __nanosleep(misses >= 3u ? 1024u : 128u << misses);
}

// Spin until the pack at `addr` (local scratch written by `peer`) is ready (I3), bounded by I7, reported by I9.
// After a timeout (exit mode) it returns whatever it loaded last: the call's outputs are garbage and the workspace
// is poisoned (I7, I12).
template <bool kWordPack>
__device__ __forceinline__ uint4 wait_for_pack(const WorkspaceView& ws, const void* addr, int peer, int phase,
                                               unsigned long long seq) {
  uint4 v = load_volatile(addr);
  bool empty = kWordPack ? word_pack_has_empty(v) : half_pack_has_empty(v);
  if (!empty) return v;
  const long long start = static_cast<long long>(global_timer_ns());
  unsigned int spins = 0;
  while (true) {
    poll_backoff(ws, spins + 1u);
    v = load_volatile(addr);
    empty = kWordPack ? word_pack_has_empty(v) : half_pack_has_empty(v);
    if (!empty) return v;
    if ((++spins & 255u) == 0u && wait_must_end(ws, start, peer, phase, seq)) return v;
  }
}

// I10: wait until the pack of every source i with bit i of `wanted` set is ready, loading all of them before
// testing any, then loading again only the ones still empty. addr(i) is source i's slot in our own scratch and
// peer(i) the rank that writes it (named in the I7/I9 reports). The index is a compile-time constant in every
// unrolled use, so v[] stays in registers.
template <int kMax, bool kWordPack, typename Addr, typename Peer>
__device__ __forceinline__ void wait_for_packs(const WorkspaceView& ws, uint4 (&v)[kMax], unsigned wanted, Addr addr,
                                               Peer peer, int phase, unsigned long long seq) {
#pragma unroll
  for (int i = 0; i < kMax; ++i)
    if ((wanted >> i) & 1u) v[i] = load_volatile(addr(i));
  unsigned missing = 0u;
#pragma unroll
  for (int i = 0; i < kMax; ++i)
    missing |= static_cast<unsigned>(((wanted >> i) & 1u) != 0u && pack_has_empty<kWordPack>(v[i])) << i;
  if (missing == 0u) return;
  const long long start = static_cast<long long>(global_timer_ns());
  unsigned int spins = 0;
  while (missing != 0u) {
    poll_backoff(ws, spins + 1u);
#pragma unroll
    for (int i = 0; i < kMax; ++i)
      if ((missing >> i) & 1u) v[i] = load_volatile(addr(i));
    unsigned still = 0u;
#pragma unroll
    for (int i = 0; i < kMax; ++i)
      still |= static_cast<unsigned>(((missing >> i) & 1u) != 0u && pack_has_empty<kWordPack>(v[i])) << i;
    missing = still;
    if (missing != 0u && (++spins & 255u) == 0u && wait_must_end(ws, start, peer(__ffs(missing) - 1), phase, seq))
      return;  // I7 exit mode: give up, v[] holds what was loaded last
  }
}

// I4 for the packs wait_for_packs returned.
template <int kMax, typename Addr>
__device__ __forceinline__ void empty_packs(unsigned wanted, Addr addr) {
#ifndef SGL_SM120_DEBUG_NO_CLEAR
#pragma unroll
  for (int i = 0; i < kMax; ++i)
    if ((wanted >> i) & 1u) store_volatile(addr(i), empty_pack());
#else
  (void)wanted;
  (void)addr;
#endif
}

// Take a ready pack and leave the slot empty for a later call (I4). SGL_SM120_DEBUG_NO_CLEAR breaks I4 on
// purpose: the tests must then see stale data or dirty scratch.
template <bool kWordPack>
__device__ __forceinline__ uint4 consume_pack(const WorkspaceView& ws, void* addr, int peer, int phase,
                                              unsigned long long seq) {
  const uint4 v = wait_for_pack<kWordPack>(ws, addr, peer, phase, seq);
#ifndef SGL_SM120_DEBUG_NO_CLEAR
  store_volatile(addr, empty_pack());
#endif
  return v;
}

// I5. SGL_SM120_DEBUG_SINGLE_BUFFER breaks it on purpose: a fast rank then overwrites scratch that a slow
// peer has not read yet.
__device__ __forceinline__ int parity_of(unsigned long long seq) {
#ifdef SGL_SM120_DEBUG_SINGLE_BUFFER
  (void)seq;
  return 0;
#else
  return static_cast<int>(seq & 1ull);
#endif
}

// bases[] hold slabs in device memory (CUDA IPC) or, with no P2P, slabs inside one shared host buffer
// (view.host_memory): the layout and every invariant above are the same for both.
__device__ __forceinline__ char* region_of(const WorkspaceView& ws, int rank, int parity) {
  return ws.bases[rank] + kRegionsOffset + static_cast<long long>(parity) * ws.region_bytes;
}

// The pull area of `rank` (transports/pull.cuh): written by that rank only, read by its peers.
__device__ __forceinline__ char* pull_area_of(const WorkspaceView& ws, int rank, int parity) {
  return ws.bases[rank] + ws.pull_offset + static_cast<long long>(parity) * ws.pull_region_bytes;
}

// The word of the flag area (ar_types.h, slab layout) that `source` writes for `phase`, CTA index `cta` and calls of
// parity `parity`. Host-callable: tests/flag_slots_check.cu checks that the words are distinct and inside the area.
__host__ __device__ __forceinline__ long long flag_index(int parity, int phase, int source, int cta) {
  return ((static_cast<long long>(parity) * kFlagPhases + phase) * kMaxWorld + source) * kMaxCounters + cta;
}

// The flag that `source` writes into `rank`'s slab for `phase`, CTA index `cta` and call `seq` (transports/pull.cuh
// P3). The parity is the call's own, never parity_of's: SGL_SM120_DEBUG_SINGLE_BUFFER breaks the data's double
// buffer (I5) on purpose, and the flags must stay exact for that build's failure to be the data's.
__device__ __forceinline__ unsigned long long* flag_of(const WorkspaceView& ws, int rank, int phase, int source,
                                                       int cta, unsigned long long seq) {
  return reinterpret_cast<unsigned long long*>(ws.bases[rank] + kCtrlBytes) +
         flag_index(static_cast<int>(seq & 1ull), phase, source, cta);
}

__device__ __forceinline__ void store_flag_release(unsigned long long* flag, unsigned long long value) {
  asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(flag), "l"(value) : "memory");
}

__device__ __forceinline__ void store_flag_relaxed(unsigned long long* flag, unsigned long long value) {
  asm volatile("st.relaxed.sys.global.u64 [%0], %1;" ::"l"(flag), "l"(value) : "memory");
}

// With a relaxed load before it that saw a release, the acquire pattern: what the releasing thread ordered before
// its release is visible to this thread after the fence. One fence ends a whole spin-wait, where an acquire load
// would invalidate L1 at every poll.
__device__ __forceinline__ void fence_acquire_system() { asm volatile("fence.acquire.sys;" ::: "memory"); }

__device__ __forceinline__ unsigned long long load_flag_relaxed(const unsigned long long* flag) {
  unsigned long long v;
  asm volatile("ld.relaxed.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(flag) : "memory");
  return v;
}

// Spin until our own flag from `peer` holds exactly `target`, this call's counter seq + 1 (transports/pull.cuh P3:
// in the word of this call's parity no later call can be, so any other value means "not yet", and a peer whose
// counter is not ours is a wait that ends in the timeout record naming this call), bounded by I7 and reported by
// I9 like every wait. The polls are relaxed loads; kAcquire: the one that sees the target is followed by an
// acquire fence, so the data the peer released before it is visible to this thread, and after a CTA barrier to
// the whole CTA. Returns false when the wait gave up (I7, exit mode).
template <bool kAcquire>
__device__ __forceinline__ bool wait_for_flag(const WorkspaceView& ws, const unsigned long long* flag,
                                              unsigned long long target, int peer, int phase, unsigned long long seq) {
  bool seen = load_flag_relaxed(flag) == target;
  if (!seen) {
    const long long start = static_cast<long long>(global_timer_ns());
    unsigned int spins = 0;
    while (!seen) {
      poll_backoff(ws, spins + 1u);
      seen = load_flag_relaxed(flag) == target;
      if (!seen && (++spins & 255u) == 0u && wait_must_end(ws, start, peer, phase, seq)) return false;
    }
  }
  if (kAcquire) fence_acquire_system();
  return true;
}

// Every thread reads its CTA's seq slot itself at entry (I5): no shared memory and no barrier before the
// first load of the input, so the loads overlap.
__device__ __forceinline__ unsigned long long load_sequence(const WorkspaceView& ws) {
  return *reinterpret_cast<volatile unsigned long long*>(&ws.ctrl->seq[blockIdx.x]);
}

// Advance seq in every slot this CTA owns (b + k * gridDim), after all of its threads have read slot b.
// Plain stores, no fence: the next reader is the next kernel in this workspace's call order (I6), and kernel
// completion publishes them; a fence here would also wait for this thread's remote pushes. CTA 0's thread 0 also
// mirrors the count into host-mapped memory (HostRecords::calls_completed) for the host's counters: one aligned
// 8-byte store, never torn, that may run a call ahead of the other CTAs' end, as slot 0 itself does.
__device__ __forceinline__ void finish_call(const WorkspaceView& ws, unsigned long long seq) {
  if (ws.host_memory) __threadfence_system();  // I11: each thread, after its own emptying stores
  __syncthreads();
  for (int i = blockIdx.x + threadIdx.x * gridDim.x; i < ws.num_counters; i += gridDim.x * blockDim.x)
    ws.ctrl->seq[i] = seq + 1ull;
  if (blockIdx.x == 0 && threadIdx.x == 0)
    *reinterpret_cast<volatile unsigned long long*>(ws.calls_completed) = seq + 1ull;
}

// Programmatic dependent launch. Kernels are launched with programmatic stream serialization (when
// enabled) so that their launch overlaps the previous kernel. Nothing may be read before pdl_wait(), which
// returns once the previous grid has completed and its memory is visible; so whatever precedes us, inputs and
// seq are read in order. We let dependents launch right away: a dependent kernel of ours also waits first,
// and all of our CTAs are resident by the time it can launch (I8 holds).
__device__ __forceinline__ void pdl_wait_and_release() {
  asm volatile("griddepcontrol.wait;" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;" :::);
}

// Start fetching `p` into L1 (no register waits for it: a hint, the load that follows hits it or joins it).
__device__ __forceinline__ void prefetch_l1(const void* p) { asm volatile("prefetch.global.L1 [%0];" ::"l"(p)); }

struct CallStart {
  bool poisoned;           // I12: return at once
  unsigned long long seq;  // this CTA's seq slot (I5)
};

// I12: the start of every kernel. Waits for the previous grid (PDL), then issues together the poisoned flag's load,
// the seq slot's (I5) and a prefetch of the thread's first input pack (`first_input`, nullptr where it has none),
// before the caller branches on the flag, so the first push waits for one round trip to memory, not two. Every
// thread reads the same flag, before any barrier.
__device__ __forceinline__ CallStart begin_call(const WorkspaceView& ws, const void* first_input) {
  pdl_wait_and_release();
  CallStart start;
  start.poisoned = workspace_poisoned(ws);
  start.seq = load_sequence(ws);
  if (first_input != nullptr) prefetch_l1(first_input);
  return start;
}

}  // namespace sgl_sm120
