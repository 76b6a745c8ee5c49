// The data-path probe, run once when a workspace is created, before its first call.
//
// cudaDeviceCanAccessPeer says what the driver allows, not what the PCIe fabric delivers: with ACS redirection
// on a switch or a translating IOMMU, peer writes can be dropped or land elsewhere while the capability still
// says yes, and the first forward of a server would then die in a timeout (I7). So every rank pushes one
// pattern pack to every peer through the very path the kernels use (its one-shot slot of parity 0 in the peer's
// slab) and waits, bounded and without trapping, for the pack of every peer in its own slab. Islands need no
// separate pass: the one-shot push reaches every peer, across islands too.
//
// Invariants kept: the slots are empty before (I1: the slab was just filled, no call has run) and after (the
// waiter empties what it read, I4), so the first real call finds clean scratch. A probe that fails leaves the
// workspace unused: the host tears it down.
#include "ar_launch.h"
#include "ar_protocol.cuh"

namespace sgl_sm120 {
namespace {

// No half-word is kEmptyHalf (I2), and the pack names sender and receiver, so a write that lands in the wrong
// slab or slot is caught, not only one that never lands.
__device__ __forceinline__ uint4 probe_pattern(int sender, int receiver) {
  return make_uint4(0x31000000u | (static_cast<uint32_t>(sender) << 8) | static_cast<uint32_t>(receiver),
                    0x52525252u, 0x13579BDFu, 0x2468ACE0u);
}

// One thread per peer. `drop_peer` (>= 0 only in the tests' debug switch) skips the push to that peer, which
// must then show up as a failed pair on that peer.
__global__ void probe_kernel(WorkspaceView ws, int drop_peer, long long timeout_ns, int* outcomes) {
  const int peer = static_cast<int>(threadIdx.x);
  if (peer >= ws.world) return;
  if (peer == ws.rank) {
    outcomes[peer] = kProbeOk;
    return;
  }
  if (peer != drop_peer)
    store_volatile(region_of(ws, peer, 0) + ws.rank * ws.oneshot_slot_bytes, probe_pattern(ws.rank, peer));
  __threadfence_system();
  char* mine = region_of(ws, ws.rank, 0) + peer * ws.oneshot_slot_bytes;
  const uint4 expect = probe_pattern(peer, ws.rank);
  const long long start = static_cast<long long>(global_timer_ns());
  int outcome = kProbeMissing;
  while (static_cast<long long>(global_timer_ns()) - start <= timeout_ns) {
    const uint4 v = load_volatile(mine);
    if (!half_pack_has_empty(v)) {  // I3: every lane has landed
      const bool same = v.x == expect.x && v.y == expect.y && v.z == expect.z && v.w == expect.w;
      outcome = same ? kProbeOk : kProbeWrong;
      break;
    }
  }
  store_volatile(mine, empty_pack());  // I4
  __threadfence_system();
  outcomes[peer] = outcome;
}

}  // namespace

std::string workspace_probe(Workspace* ws, long long timeout_ns, int drop_peer, int* outcomes) {
  cudaError_t err = cudaSetDevice(ws->device);
  int* d_outcomes = nullptr;
  if (err == cudaSuccess) err = cudaMalloc(&d_outcomes, kMaxWorld * sizeof(int));
  if (err == cudaSuccess) err = cudaMemset(d_outcomes, 0, kMaxWorld * sizeof(int));
  if (err == cudaSuccess) {
    probe_kernel<<<1, 32>>>(ws->view, drop_peer, timeout_ns, d_outcomes);
    err = cudaGetLastError();
  }
  if (err == cudaSuccess) err = cudaDeviceSynchronize();
  if (err == cudaSuccess) err = cudaMemcpy(outcomes, d_outcomes, kMaxWorld * sizeof(int), cudaMemcpyDeviceToHost);
  if (d_outcomes != nullptr) cudaFree(d_outcomes);
  if (err != cudaSuccess)
    return std::string("data-path probe: ") + cudaGetErrorName(err) + " (" + cudaGetErrorString(err) + ")";
  return "";
}

}  // namespace sgl_sm120
