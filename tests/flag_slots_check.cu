// Host-only check of the flag words (csrc/ar_types.h slab layout, ar_protocol.cuh flag_index; transports/pull.cuh
// P3), built and run by tests/test_flag_slots.py. A wait compares a word with its own call's counter for equality,
// which is exact only if every (call parity, phase, source, CTA) has a word of its own: two of them sharing one
// would let a call of the other parity overwrite the counter a waiter needs, and it would wait forever. The words
// must also stay inside the flag area (the push region follows it), and the construction probe must reach both
// ends of the area, which now holds both parities.
#include <cstdio>
#include <vector>

#include "../csrc/probe.cu"
#include "../csrc/workspace.cu"

namespace sgl_sm120 {
// workspace.cu's creation path calls it (it lives with the kernels); never reached here.
cudaError_t query_cluster_capacity(int, int, int, int*) { return cudaErrorNotSupported; }
}  // namespace sgl_sm120

namespace {

int failures = 0;

void fail(const char* what, long long a, long long b) {
  if (++failures <= 20) std::printf("FAIL %s: %lld %lld\n", what, a, b);
}

}  // namespace

int main() {
  using namespace sgl_sm120;
  const long long words = kFlagBytes / 8;
  if (kRegionsOffset != kCtrlBytes + kFlagBytes) fail("the push region does not follow the flags", kRegionsOffset, 0);
  std::vector<int> owners(static_cast<size_t>(words), 0);
  for (int parity = 0; parity < kFlagParities; ++parity)
    for (int phase = 0; phase < kFlagPhases; ++phase)
      for (int source = 0; source < kMaxWorld; ++source)
        for (int cta = 0; cta < kMaxCounters; ++cta) {
          const long long at = flag_index(parity, phase, source, cta);
          if (at < 0 || at >= words) {
            fail("a flag word outside the flag area", at, words);
          } else if (++owners[static_cast<size_t>(at)] > 1) {
            fail("a flag word shared by two (parity, phase, source, CTA)", at, parity);
          }
        }
  for (long long at = 0; at < words; ++at)
    if (owners[static_cast<size_t>(at)] != 1) fail("a word of the flag area that no flag uses", at, 0);
  // The probe's flag rounds (one per parity region) write the first and last pack of the whole area.
  for (int world : {2, 4, 8}) {
    Topology flat{};
    flat.island_size = world;
    flat.num_islands = 1;
    Topology none{};
    const ScratchSizes z = scratch_sizes(world, 3 * 7168, 3 * 7168, flat, none);
    WorkspaceView v{};
    v.world = world;
    v.region_bytes = z.region;
    v.oneshot_slot_bytes = z.oneshot_slot;
    v.chunk_slot_bytes = z.chunk_slot;
    v.pull_offset = kRegionsOffset + 2 * z.region;
    v.pull_region_bytes = z.pull_region;
    v.pull_input_bytes = z.pull_input;
    v.flat = flat;
    bool first = false, last = false;
    for (int round = 0; round < write_round_count(v); ++round) {
      if (area_of(v, round) != kAreaFlags) continue;
      for (int sender = 0; sender < world; ++sender) {
        first |= probe_place(v, round, sender, 0) == kCtrlBytes;
        last |= probe_place(v, round, sender, 1) == kCtrlBytes + kFlagBytes - kPackBytes;
      }
    }
    if (!first || !last) fail("the probe misses an end of the flag area", world, first + 2 * last);
  }
  if (failures == 0) std::printf("OK\n");
  return failures == 0 ? 0 : 1;
}
