// Host-only check of the flag words (csrc/ar_types.h slab layout, ar_protocol.cuh flag_index; transports/pull.cuh
// P3), built and run by tests/test_flag_slots.py. A wait compares a word with its own call's counter for equality,
// which is exact only if every (call parity, phase, source, CTA) has a word of its own: two of them sharing one
// would let a call of the other parity overwrite the counter a waiter needs, and it would wait forever. The words
// must also fill the flag area and stay inside it (the push region follows it). (That the construction probe
// reaches both ends of the area is tests/probe_places_check.cu's.)
#include <cstdio>
#include <vector>

#include "../csrc/ar_protocol.cuh"

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
  if (failures == 0) std::printf("OK\n");
  return failures == 0 ? 0 : 1;
}
