// The staged push: the very bytes push sends, ordered as permutation passes. In pass p rank r stores
// only into rank (r + 1 + p) mod W (of the flat group, or of its island for the reduce-scatter and all-gather
// phases), then tells that rank it is done and waits until the rank that stores into r in pass p, (r - 1 - p) mod
// W, has told r the same. At any moment each GPU then has one outbound and one inbound stream: the pattern that
// does not collapse where several GPUs behind one switch posting writes to several root complexes do (FlashInfer's
// PCIe all-reduce stages its pushes so). It costs a pacing barrier per pass,
// so it is meant for few CTAs. A window of w passes lets the stores of w passes be in flight before the first of
// their pacing waits: w streams each way, from 1 (the pattern above) to W - 1 (push's stores, paced only at the end).
//
// Invariants (relied on by the code below):
//  S1  Readiness is push's: sentinels in the data, consumers empty what they read (I1-I4). The pass flags only
//      pace the passes: nothing is read on their account, so a flag that overtakes its data costs some overlap,
//      never a wrong result, and they need no release/acquire. So any window is correct: it moves only the point
//      where a CTA waits for a flag, never what a consumer reads. The flags are counters in pull's words, one per
//      call parity, and a pacing wait is for its own call's counter exactly (P3), so a peer that never makes its
//      pass ends the wait in the timeout record naming the call.
//  S2  The passes reach every peer once per call: (r + 1 + p) mod W over p = 0 .. W-2 is every other rank, whatever
//      the window. SGL_SM120_DEBUG_STAGED_SKIP_PASS drops the last pass on purpose (its stores, its flag and its
//      wait): its packs never arrive, and the waits must end in the timeout error (I7), never in a hang or a wrong
//      sum.
//  S3  Every thread of a CTA goes through every pass, a CTA barrier after each pass's stores; one thread per CTA
//      stores each pass's flag. With a window of w (1 .. W-1, clamped to the passes), the pacing wait of pass p is
//      made once the stores of pass p + w - 1 are issued, by one thread, with a barrier after it; the w - 1 waits
//      left after the last pass are made by as many threads at once, then a barrier. So every pacing wait of the
//      call is made, bounded and reported like every wait (I7, I9), before any thread leaves the passes.
//  S4  Pass p stores exactly the packs push stores to its destination (the same remapped values, I2), whether a
//      thread keeps its packs in registers across the passes (ThreadPacks, ar_kernels.cu: when it has no more than
//      the kernel's bound, which keeps every kernel spill-free) or reads them from the input in every pass.
#pragma once

#include "../ar_protocol.cuh"

namespace sgl_sm120 {

// Runs kPasses passes with at most `window` of them ahead of their pacing waits (S3). `pass(p)` stores pass p's packs
// and returns the rank they went to; `source(p)` is the rank that stores into us in pass p. Pacing flags of
// `flag_phase` (S1), reported as `report_phase` when late.
template <int kPasses, typename Pass, typename Source>
__device__ __forceinline__ void staged_passes(const WorkspaceView& ws, unsigned long long seq, int window,
                                              int flag_phase, int report_phase, Pass pass, Source source) {
#ifdef SGL_SM120_DEBUG_STAGED_SKIP_PASS
  constexpr int kRun = kPasses - 1;  // S2 broken on purpose: the last pass is never made
#else
  constexpr int kRun = kPasses;
#endif
  const int ahead = window < 1 ? 1 : (window > kPasses ? kPasses : window);
  auto wait_for_pass = [&](int q) {
    const int from = source(q);
    wait_for_flag<false>(ws, flag_of(ws, ws.rank, flag_phase, from, blockIdx.x, seq), seq + 1ull, from,
                         report_phase, seq);
  };
#pragma unroll 1
  for (int p = 0; p < kRun; ++p) {
    const int dest = pass(p);
    __syncthreads();  // S3: the CTA's stores of this pass are issued
    const int due = p + 1 - ahead;  // the pass whose pacing wait is due now (S3), the same on every thread
    if (threadIdx.x == 0) {
      store_flag_relaxed(flag_of(ws, dest, flag_phase, ws.rank, blockIdx.x, seq), seq + 1ull);
      if (due >= 0) wait_for_pass(due);
    }
    if (due >= 0) __syncthreads();
  }
  const int left = ahead - 1 < kRun ? ahead - 1 : kRun;  // S3: the waits not yet made, one thread each
  if (left > 0) {
    if (static_cast<int>(threadIdx.x) < left) wait_for_pass(kRun - left + static_cast<int>(threadIdx.x));
    __syncthreads();
  }
}

}  // namespace sgl_sm120
