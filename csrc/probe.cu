// The data-path probe, run once when a workspace is created, before its first call.
// Its places cover every area a transport writes or reads remotely: push's slots, pull's areas and the flags.
//
// cudaDeviceCanAccessPeer says what the driver allows, not what the PCIe fabric delivers: with ACS redirection
// on a switch or a translating IOMMU, peer writes can be dropped or land elsewhere while the capability still
// says yes, and the first forward of a server would then die in a timeout (I7). A mapping can also be broken
// for part of a slab only. So every rank writes pattern packs to every peer through the very path the kernels
// use, at the edges of every area the kernels write: in each parity region, the first and last pack of every
// one-shot slot, of every chunk-sized block (the reduce-scatter, cross-island and all-gather slots are made of
// those), and the end of the region. It then waits, bounded and without trapping, for every peer's packs in
// its own slab. Islands need no separate pass: every rank writes to every peer, across islands too.
//
// Rounds: within one round the places of different senders never overlap; across rounds they may (a chunk
// block can start where a one-shot slot does), so the host separates rounds by a group barrier, and a receiver
// has emptied a round's packs before any sender writes the next round's.
//
// Invariants kept: the places are empty before (I1: the slab was just filled, no call has run) and after (the
// waiter empties what it read, I4), so the first real call finds clean scratch. A probe that fails leaves the
// workspace unused: the host tears it down.
#include <algorithm>

#include "ar_launch.h"
#include "ar_protocol.cuh"

namespace sgl_sm120 {
namespace {

// The rounds of one parity: one-shot slots, then the chunk blocks W at a time, then the push region's end, the
// pull area's ends (transports/pull.cuh), and the flag area's ends (its flags are parity-free; probed with each
// parity alike).
__host__ __device__ __forceinline__ long long chunk_blocks(const WorkspaceView& v) {
  return v.chunk_slot_bytes > 0 ? v.region_bytes / v.chunk_slot_bytes : 0;
}
__host__ __device__ __forceinline__ int chunk_rounds(const WorkspaceView& v) {
  return static_cast<int>((chunk_blocks(v) + v.world - 1) / v.world);
}
__host__ __device__ __forceinline__ int rounds_per_parity(const WorkspaceView& v) { return 4 + chunk_rounds(v); }

// The round's kind within its parity.
enum ProbeArea : int { kAreaOneShot, kAreaChunks, kAreaRegionEnd, kAreaPull, kAreaFlags };
__host__ __device__ __forceinline__ int area_of(const WorkspaceView& v, int round) {
  const int k = round % rounds_per_parity(v);
  if (k == 0) return kAreaOneShot;
  if (k <= chunk_rounds(v)) return kAreaChunks;
  return kAreaRegionEnd + (k - 1 - chunk_rounds(v));
}

// The slab offset of place `which` (0: first, 1: last) that `sender` writes in `round`, or -1. Different senders'
// places never overlap within a round.
__host__ __device__ __forceinline__ long long probe_place(const WorkspaceView& v, int round, int sender, int which) {
  const int per = rounds_per_parity(v);
  const int parity = round / per;
  const long long region = kRegionsOffset + parity * v.region_bytes;
  long long first, last;
  switch (area_of(v, round)) {
    case kAreaOneShot:
      first = region + sender * v.oneshot_slot_bytes;
      last = first + v.oneshot_slot_bytes - kPackBytes;
      break;
    case kAreaChunks: {
      const long long block = static_cast<long long>(round % per - 1) * v.world + sender;
      if (block >= chunk_blocks(v)) return -1;
      first = region + block * v.chunk_slot_bytes;
      last = first + v.chunk_slot_bytes - kPackBytes;
      break;
    }
    case kAreaRegionEnd:
      first = last = region + v.region_bytes - static_cast<long long>(sender + 1) * kPackBytes;
      break;
    case kAreaPull: {
      const long long pull = v.pull_offset + parity * v.pull_region_bytes;
      first = pull + sender * kPackBytes;
      last = pull + v.pull_region_bytes - static_cast<long long>(sender + 1) * kPackBytes;
      break;
    }
    default:  // kAreaFlags
      first = kCtrlBytes + sender * kPackBytes;
      last = kCtrlBytes + kFlagBytes - static_cast<long long>(sender + 1) * kPackBytes;
      break;
  }
  if (which == 1 && last == first) return -1;
  return which == 0 ? first : last;
}

// No half-word is kEmptyHalf (I2), and the pack names sender, receiver, round and place, so a write that lands in
// the wrong slab or place is caught, not only one that never lands.
__device__ __forceinline__ uint4 probe_pattern(int sender, int receiver, int round, int which) {
  return make_uint4(0x31000000u | (static_cast<uint32_t>(sender) << 8) | static_cast<uint32_t>(receiver),
                    0x52000000u | (static_cast<uint32_t>(round) << 4) | static_cast<uint32_t>(which), 0x13579BDFu,
                    0x2468ACE0u);
}

// Thread 2p + which handles place `which` with peer p: it writes ours into p's slab, then waits for p's in ours.
// `drop_peer` (>= 0 only in the tests' debug switch) skips the writes to that peer, which must then show up as a
// failed pair on that peer.
__global__ void probe_kernel(WorkspaceView ws, int round, int drop_peer, long long timeout_ns, int* outcomes) {
  const int peer = static_cast<int>(threadIdx.x) >> 1;
  const int which = static_cast<int>(threadIdx.x) & 1;
  if (peer >= ws.world || peer == ws.rank) return;
  const long long send_at = probe_place(ws, round, ws.rank, which);
  if (send_at >= 0 && peer != drop_peer)
    store_volatile(ws.bases[peer] + send_at, probe_pattern(ws.rank, peer, round, which));
  __threadfence_system();
  const long long receive_at = probe_place(ws, round, peer, which);
  // Scratch starts empty (I1) and flags start at 0 (P3): a place has "landed" once it is no longer that, and is
  // left so again.
  const bool flags = area_of(ws, round) == kAreaFlags;
  int outcome = kProbeOk;
  if (receive_at >= 0) {
    char* mine = ws.bases[ws.rank] + receive_at;
    const uint4 expect = probe_pattern(peer, ws.rank, round, which);
    const long long start = static_cast<long long>(global_timer_ns());
    outcome = kProbeMissing;
    while (static_cast<long long>(global_timer_ns()) - start <= timeout_ns) {
      const uint4 v = load_volatile(mine);
      const bool landed = flags ? (v.x | v.y | v.z | v.w) != 0u : !half_pack_has_empty(v);  // I3 per lane
      if (landed) {
        const bool same = v.x == expect.x && v.y == expect.y && v.z == expect.z && v.w == expect.w;
        outcome = same ? kProbeOk : kProbeWrong;
        break;
      }
    }
    store_volatile(mine, flags ? make_uint4(0u, 0u, 0u, 0u) : empty_pack());  // I4 / P3
    __threadfence_system();
  }
  if (outcome != kProbeOk) atomicMax(&outcomes[peer], outcome);
}

}  // namespace

int probe_round_count(const WorkspaceView& view) { return 2 * rounds_per_parity(view); }

std::string probe_round_name(const WorkspaceView& view, int round) {
  const int per = rounds_per_parity(view);
  const int k = round % per;
  std::string where;
  switch (area_of(view, round)) {
    case kAreaOneShot: where = "the one-shot slots (first and last pack)"; break;
    case kAreaChunks: {
      const long long first = static_cast<long long>(k - 1) * view.world;
      const long long last = std::min<long long>(first + view.world, chunk_blocks(view)) - 1;
      where = "chunk blocks " + std::to_string(first) + "-" + std::to_string(last) + " of " +
              std::to_string(chunk_blocks(view)) + " (first and last pack)";
      break;
    }
    case kAreaRegionEnd: where = "the end of the region"; break;
    case kAreaPull: where = "the pull area (both ends)"; break;
    default: where = "the flags (both ends)"; break;
  }
  return "parity " + std::to_string(round / per) + ", " + where;
}

std::string workspace_probe(Workspace* ws, long long timeout_ns, int round, int drop_peer, int* outcomes) {
  if (round < 0 || round >= probe_round_count(ws->view)) return "probe round out of range";
  cudaError_t err = cudaSetDevice(ws->device);
  int* d_outcomes = nullptr;
  if (err == cudaSuccess) err = cudaMalloc(&d_outcomes, kMaxWorld * sizeof(int));
  if (err == cudaSuccess) err = cudaMemset(d_outcomes, 0, kMaxWorld * sizeof(int));
  if (err == cudaSuccess) {
    probe_kernel<<<1, 2 * kMaxWorld>>>(ws->view, round, drop_peer, timeout_ns, d_outcomes);
    err = cudaGetLastError();
  }
  if (err == cudaSuccess) err = cudaDeviceSynchronize();
  if (err == cudaSuccess) err = cudaMemcpy(outcomes, d_outcomes, kMaxWorld * sizeof(int), cudaMemcpyDeviceToHost);
  if (d_outcomes != nullptr) cudaFree(d_outcomes);
  if (err != cudaSuccess)
    return std::string("data-path probe: ") + cudaGetErrorName(err) + " (" + cudaGetErrorString(err) + ")";
  for (int p = 0; p < kMaxWorld; ++p)
    if (outcomes[p] == 0) outcomes[p] = kProbeOk;  // no place failed
  return "";
}

}  // namespace sgl_sm120
