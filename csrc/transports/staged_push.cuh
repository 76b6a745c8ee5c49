// The staged push (issue 17): the very bytes push sends, ordered as permutation passes. In pass p rank r stores
// only into rank (r + 1 + p) mod W (of the flat group, or of its island for the reduce-scatter and all-gather
// phases), then tells that rank it is done and waits until the rank that stores into r in pass p, (r - 1 - p) mod
// W, has told r the same. At any moment each GPU then has one outbound and one inbound stream: the pattern that
// does not collapse where several GPUs behind one switch posting writes to several root complexes do (FlashInfer's
// PCIe all-reduce stages its pushes so; ../shared/notes/pcie_transports.md). It costs a pacing barrier per pass,
// so it is meant for few CTAs.
//
// Invariants (relied on by the code below):
//  S1  Readiness is push's: sentinels in the data, consumers empty what they read (I1-I4). The pass flags only
//      pace the passes: nothing is read on their account, so a flag that overtakes its data costs some overlap,
//      never a wrong result, and they need no release/acquire. They are counters in pull's words, one per call
//      parity, and a pacing wait is for its own call's counter exactly (P3), so a peer that never makes its pass
//      ends the wait in the timeout record naming the call.
//  S2  The passes reach every peer once per call: (r + 1 + p) mod W over p = 0 .. W-2 is every other rank.
//      SGL_SM120_DEBUG_STAGED_SKIP_PASS drops the last pass on purpose: its packs never arrive, and the waits
//      must end in the timeout error (I7), never in a hang or a wrong sum.
//  S3  Every thread of a CTA goes through every pass (a CTA barrier ends each), and one thread per CTA stores and
//      waits on the flags; the pacing waits are bounded and reported like every wait (I7, I9).
#pragma once

#include "../ar_protocol.cuh"

namespace sgl_sm120 {

// Runs kPasses passes. `pass(p)` stores pass p's packs and returns the rank they went to; `source(p)` is the rank
// that stores into us in pass p. Pacing flags of `flag_phase` (S1), reported as `report_phase` when late.
template <int kPasses, typename Pass, typename Source>
__device__ __forceinline__ void staged_passes(const WorkspaceView& ws, unsigned long long seq, int flag_phase,
                                              int report_phase, Pass pass, Source source) {
#pragma unroll 1
  for (int p = 0; p < kPasses; ++p) {
#ifdef SGL_SM120_DEBUG_STAGED_SKIP_PASS
    if (p == kPasses - 1) break;  // S2 broken on purpose
#endif
    const int dest = pass(p);
    __syncthreads();  // S3: the CTA's stores of this pass are issued
    if (threadIdx.x == 0) {
      store_flag_relaxed(flag_of(ws, dest, flag_phase, ws.rank, blockIdx.x, seq), seq + 1ull);
      const int from = source(p);
      wait_for_flag<false>(ws, flag_of(ws, ws.rank, flag_phase, from, blockIdx.x, seq), seq + 1ull, from,
                           report_phase, seq);
    }
    __syncthreads();
  }
}

}  // namespace sgl_sm120
