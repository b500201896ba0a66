// The transfer engine (gpu/page_transfer.hpp) and its bookkeeping (gpu/page_residency.hpp).
//
// PageResidency runs everywhere: LRU and CLOCK order, pinning of a step's pages, duplicates,
// refusals, and a random walk checked against a model of which page sits in which slot. The
// DevicePageCache tests need a device and skip without one: over random pools and several steps of
// random id sets (part of each step repeated from the last), each path's device pool is compared
// byte for byte with what each page held on the host when it was loaded; host pages are rewritten
// between steps, so a hit that was sent again would show as the new bytes.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <map>
#include <numeric>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "gpu/host_memory.hpp"
#include "gpu/page_residency.hpp"
#include "gpu/page_transfer.hpp"

#if KVSIFT_TEST_WITH_CUDA
#include <cuda_runtime.h>
#endif

using namespace kvsift;

namespace {

constexpr uint32_t kNone = gpu::PageResidency::kNone;

#define ASSERT_OK(expr)                             \
  do {                                              \
    const gpu::Result r_ = (expr);                  \
    ASSERT_TRUE(r_.ok) << #expr ": " << r_.message; \
  } while (0)

std::vector<uint32_t> plan(gpu::PageResidency& residency, const std::vector<uint32_t>& ids,
                           gpu::StepMode mode = gpu::StepMode::next) {
  std::vector<uint32_t> slots(ids.size(), 0xdeadbeef);
  const gpu::Result r = residency.plan(ids.data(), ids.size(), slots.data(), mode);
  EXPECT_TRUE(r.ok) << r.message;
  return slots;
}

class Residency : public ::testing::TestWithParam<gpu::EvictionPolicy> {};

TEST_P(Residency, hits_keep_their_slots_and_only_misses_move) {
  gpu::PageResidency residency;
  ASSERT_OK(residency.init(4, 100, GetParam()));
  const std::vector<uint32_t> first = plan(residency, {10, 11, 12});
  EXPECT_EQ(residency.moves().size(), 3u);
  EXPECT_EQ(residency.last_counts().misses, 3u);
  const std::vector<uint32_t> second = plan(residency, {12, 10, 13});
  EXPECT_EQ(second[0], first[2]);
  EXPECT_EQ(second[1], first[0]);
  ASSERT_EQ(residency.moves().size(), 1u);
  EXPECT_EQ(residency.moves()[0].host_slot, 13u);
  EXPECT_EQ(residency.moves()[0].device_slot, second[2]);
  EXPECT_EQ(residency.last_counts().hits, 2u);
  EXPECT_EQ(residency.last_counts().evictions, 0u);
}

TEST_P(Residency, duplicates_share_one_slot_and_move_once) {
  gpu::PageResidency residency;
  ASSERT_OK(residency.init(2, 100, GetParam()));
  const std::vector<uint32_t> slots = plan(residency, {7, 7, 8, 7, 8});
  EXPECT_EQ(residency.moves().size(), 2u);
  EXPECT_EQ(slots[0], slots[1]);
  EXPECT_EQ(slots[0], slots[3]);
  EXPECT_EQ(slots[2], slots[4]);
  EXPECT_NE(slots[0], slots[2]);
  EXPECT_EQ(residency.last_counts().requested, 5u);
  plan(residency, {8, 8});
  EXPECT_EQ(residency.last_counts().hits, 1u);
  EXPECT_TRUE(residency.moves().empty());
}

TEST_P(Residency, never_evicts_a_page_of_its_own_step) {
  // The cache holds exactly one step's pages: every miss must evict a page the step does not
  // name, however the policy ranks the step's hits.
  gpu::PageResidency residency;
  ASSERT_OK(residency.init(6, 1000, GetParam()));
  std::mt19937 rng(7);
  std::vector<uint32_t> previous;
  for (int step = 0; step < 200; ++step) {
    std::set<uint32_t> ids;
    for (uint32_t id : previous)
      if (rng() % 2) ids.insert(id);
    while (ids.size() < 6) ids.insert(rng() % 40);
    std::vector<uint32_t> request(ids.begin(), ids.end());
    std::shuffle(request.begin(), request.end(), rng);
    const std::vector<uint32_t> slots = plan(residency, request);
    std::set<uint32_t> distinct(slots.begin(), slots.end());
    ASSERT_EQ(distinct.size(), request.size()) << "two pages of step " << step << " share a slot";
    for (std::size_t i = 0; i < request.size(); ++i)
      ASSERT_EQ(residency.find(request[i]), slots[i]) << "step " << step;
    previous = request;
  }
}

// A plan's moves applied to a model of the slots (host page -> device slot): a moved page was not
// resident, and takes its slot from the page that held it, which the step must not need.
void apply_moves(const gpu::PageResidency& residency, const std::vector<uint32_t>& request,
                 std::map<uint32_t, uint32_t>& model, int step) {
  for (const gpu::PageMove& m : residency.moves()) {
    ASSERT_FALSE(model.count(m.host_slot)) << "a resident page moved, step " << step;
    for (auto it = model.begin(); it != model.end(); ++it)
      if (it->second == m.device_slot) {
        ASSERT_FALSE(std::count(request.begin(), request.end(), it->first))
            << "step " << step << " evicted page " << it->first << ", which it needs";
        model.erase(it);
        break;
      }
    model[m.host_slot] = m.device_slot;
  }
}

TEST_P(Residency, agrees_with_a_model_of_the_slots_over_a_random_walk) {
  gpu::PageResidency residency;
  ASSERT_OK(residency.init(64, 5000, GetParam()));
  std::mt19937 rng(11);
  std::map<uint32_t, uint32_t> model;  // host -> device, as the plans and moves say
  std::vector<uint32_t> previous;
  for (int step = 0; step < 300; ++step) {
    std::vector<uint32_t> request;
    for (uint32_t id : previous)
      if (rng() % 4 != 0) request.push_back(id);
    const uint32_t fresh = 1 + rng() % 24;
    for (uint32_t i = 0; i < fresh; ++i) request.push_back(rng() % 400);
    std::set<uint32_t> distinct(request.begin(), request.end());
    if (distinct.size() > 64) request.assign(distinct.begin(), std::next(distinct.begin(), 64));
    std::shuffle(request.begin(), request.end(), rng);
    const std::map<uint32_t, uint32_t> before = model;
    const std::vector<uint32_t> slots = plan(residency, request);
    // Moves are exactly the requested pages that were not resident, each once.
    std::set<uint32_t> expected_moves;
    for (uint32_t id : request)
      if (!before.count(id)) expected_moves.insert(id);
    std::set<uint32_t> moved;
    for (const gpu::PageMove& m : residency.moves())
      ASSERT_TRUE(moved.insert(m.host_slot).second) << "page " << m.host_slot << " moved twice";
    ASSERT_EQ(moved, expected_moves) << "step " << step;
    ASSERT_NO_FATAL_FAILURE(apply_moves(residency, request, model, step));
    for (std::size_t i = 0; i < request.size(); ++i) {
      ASSERT_EQ(slots[i], model.at(request[i])) << "step " << step;
      if (before.count(request[i])) {
        ASSERT_EQ(slots[i], before.at(request[i])) << "hit moved";
      }
    }
    for (const auto& [host, device] : model) ASSERT_EQ(residency.find(host), device);
    ASSERT_EQ(residency.resident(), model.size());
    previous = request;
  }
}

TEST_P(Residency, refuses_a_step_larger_than_its_capacity_and_changes_nothing) {
  gpu::PageResidency residency;
  ASSERT_OK(residency.init(3, 100, GetParam()));
  const std::vector<uint32_t> kept = plan(residency, {1, 2, 3});
  const std::vector<uint32_t> ids = {4, 1, 5, 4, 6};
  std::vector<uint32_t> slots(ids.size());
  const gpu::Result r = residency.plan(ids.data(), ids.size(), slots.data());
  EXPECT_FALSE(r.ok);
  EXPECT_FALSE(r.unsupported);
  EXPECT_NE(r.message.find("needs 4 distinct pages, more than the cache's 3 slots"),
            std::string::npos)
      << r.message;
  for (uint32_t i = 0; i < 3; ++i) EXPECT_EQ(residency.find(i + 1), kept[i]);
  EXPECT_EQ(residency.find(4), kNone);
  plan(residency, {3, 2, 1});
  EXPECT_EQ(residency.last_counts().hits, 3u);
}

TEST_P(Residency, refuses_ids_outside_the_pool) {
  gpu::PageResidency residency;
  ASSERT_OK(residency.init(8, 100, GetParam()));
  const std::vector<uint32_t> ids = {5, 100};
  std::vector<uint32_t> slots(2);
  const gpu::Result r = residency.plan(ids.data(), ids.size(), slots.data());
  EXPECT_FALSE(r.ok);
  EXPECT_NE(r.message.find("host slot 100 at index 1 is outside the pool's 100 slots"),
            std::string::npos)
      << r.message;
  EXPECT_EQ(residency.find(5), kNone);
  EXPECT_EQ(residency.resident(), 0u);
}

TEST_P(Residency, forgotten_moves_are_misses_again) {
  gpu::PageResidency residency;
  ASSERT_OK(residency.init(4, 100, GetParam()));
  plan(residency, {1, 2});
  plan(residency, {2, 3});
  residency.forget_moves();
  EXPECT_EQ(residency.find(3), kNone);
  EXPECT_NE(residency.find(2), kNone);
  EXPECT_EQ(residency.resident(), 2u);
  plan(residency, {3});
  EXPECT_EQ(residency.moves().size(), 1u);
}

TEST_P(Residency, refuses_a_step_whose_hits_come_after_its_misses) {
  // The count of distinct pages must include the hits after the last miss.
  gpu::PageResidency residency;
  ASSERT_OK(residency.init(3, 100, GetParam()));
  const std::vector<uint32_t> kept = plan(residency, {1, 2, 3});
  const std::vector<uint32_t> ids = {4, 5, 1, 2};
  std::vector<uint32_t> slots(ids.size());
  const gpu::Result r = residency.plan(ids.data(), ids.size(), slots.data());
  EXPECT_FALSE(r.ok);
  EXPECT_NE(r.message.find("needs 4 distinct pages"), std::string::npos) << r.message;
  for (uint32_t i = 0; i < 3; ++i) EXPECT_EQ(residency.find(i + 1), kept[i]);
  EXPECT_EQ(residency.find(4), kNone);
  EXPECT_EQ(residency.find(5), kNone);
  EXPECT_EQ(residency.resident(), 3u);
  // The refused misses left nothing behind: they are plain misses now, each moved once.
  const std::vector<uint32_t> next = plan(residency, {4, 5, 4, 1});
  EXPECT_EQ(residency.moves().size(), 2u);
  EXPECT_EQ(next[0], next[2]);
  EXPECT_EQ(next[3], kept[0]);
  EXPECT_EQ(residency.last_counts().hits, 1u);
  EXPECT_EQ(residency.last_counts().evictions, 2u);
}

TEST_P(Residency, takes_ids_up_to_the_last_host_slot) {
  // The largest pool, 2^32 - 1 slots: ids up to 2^32 - 2 are pages, 2^32 - 1 (kNone) is not.
  gpu::PageResidency residency;
  ASSERT_OK(residency.init(4, kNone, GetParam()));
  const std::vector<uint32_t> ids = {kNone - 1, 0, kNone - 2, kNone - 1};
  const std::vector<uint32_t> slots = plan(residency, ids);
  EXPECT_EQ(residency.moves().size(), 3u);
  EXPECT_EQ(slots[0], slots[3]);
  EXPECT_EQ(residency.find(kNone - 1), slots[0]);
  EXPECT_EQ(residency.find(0), slots[1]);
  EXPECT_EQ(residency.find(kNone - 2), slots[2]);
  const uint32_t bad = kNone;
  uint32_t slot = 0;
  EXPECT_FALSE(residency.plan(&bad, 1, &slot).ok);
  plan(residency, {kNone - 1, 0});
  EXPECT_EQ(residency.last_counts().hits, 2u);
  EXPECT_TRUE(residency.moves().empty());
}

TEST_P(Residency, clear_empties_the_cache_for_reuse) {
  gpu::PageResidency residency;
  ASSERT_OK(residency.init(4, 1000, GetParam()));
  plan(residency, {1, 2, 3, 4});
  plan(residency, {5, 1});
  residency.clear();
  EXPECT_EQ(residency.resident(), 0u);
  for (uint32_t id = 1; id <= 5; ++id) EXPECT_EQ(residency.find(id), kNone);
  // Every page is a miss again and takes a free slot; then the cache fills and evicts as new.
  const std::vector<uint32_t> slots = plan(residency, {5, 6, 1, 7});
  EXPECT_EQ(residency.moves().size(), 4u);
  EXPECT_EQ(residency.last_counts().evictions, 0u);
  EXPECT_EQ(std::set<uint32_t>(slots.begin(), slots.end()).size(), 4u);
  plan(residency, {8, 6});
  EXPECT_EQ(residency.last_counts().evictions, 1u);
  EXPECT_EQ(residency.find(6), slots[1]);
  EXPECT_EQ(residency.resident(), 4u);
}

TEST_P(Residency, agrees_with_a_model_over_a_long_walk_of_large_steps) {
  // Steps of hundreds of pages with duplicates, strided ids as a pool interleaving layers hands
  // out, a cache of a few steps' pages (so that the map's buckets fill and overflow), refused
  // steps and forgotten moves: after each step every page sits where the plans and moves put it.
  gpu::PageResidency residency;
  constexpr uint32_t kCapacity = 1000;
  ASSERT_OK(residency.init(kCapacity, uint64_t{1} << 24, GetParam()));
  std::mt19937 rng(23);
  std::map<uint32_t, uint32_t> model;
  std::vector<uint32_t> previous;
  for (int step = 0; step < 400; ++step) {
    std::vector<uint32_t> request;
    for (uint32_t id : previous)
      if (rng() % 10 != 0) request.push_back(id);
    const uint32_t fresh = 10 + rng() % 60;
    for (uint32_t i = 0; i < fresh; ++i) request.push_back((rng() % 30000) * 256 + 40 + rng() % 8);
    const bool too_many = step % 50 == 49;
    if (too_many)
      for (uint32_t i = 0; i <= kCapacity; ++i) request.push_back(uint32_t{1} << 23 | i);
    std::set<uint32_t> distinct(request.begin(), request.end());
    if (!too_many && distinct.size() > 400)
      request.assign(distinct.begin(), std::next(distinct.begin(), 400));
    for (std::size_t i = 0, d = request.size() / 8; i < d; ++i)
      request.push_back(request[rng() % request.size()]);
    std::shuffle(request.begin(), request.end(), rng);
    std::vector<uint32_t> slots(request.size());
    const gpu::Result r = residency.plan(request.data(), request.size(), slots.data());
    ASSERT_EQ(r.ok, !too_many) << "step " << step << ": " << r.message;
    if (r.ok) {
      ASSERT_NO_FATAL_FAILURE(apply_moves(residency, request, model, step));
      for (std::size_t i = 0; i < request.size(); ++i)
        ASSERT_EQ(slots[i], model.at(request[i])) << "step " << step;
      std::set<uint32_t> used(slots.begin(), slots.end());
      ASSERT_EQ(used.size(), std::set<uint32_t>(request.begin(), request.end()).size());
      if (step % 7 == 3) {
        for (const gpu::PageMove& m : residency.moves()) model.erase(m.host_slot);
        residency.forget_moves();
      }
      previous.clear();
      for (uint32_t id : request)
        if (!(id & uint32_t{1} << 23)) previous.push_back(id);
    }
    for (const auto& [host, device] : model) ASSERT_EQ(residency.find(host), device);
    ASSERT_EQ(residency.resident(), model.size());
  }
}

TEST_P(Residency, a_step_planned_in_pieces_keeps_its_earlier_pieces_pinned) {
  gpu::PageResidency residency;
  ASSERT_OK(residency.init(6, 1000, GetParam()));
  plan(residency, {1, 2, 3});
  // The next step in three pieces: the second piece's misses must evict the last step's pages,
  // never the first piece's, whatever the policy thinks of them.
  const std::vector<uint32_t> a = plan(residency, {4, 5, 6});
  EXPECT_EQ(residency.last_counts().evictions, 0u);
  const std::vector<uint32_t> b = plan(residency, {7, 8, 9}, gpu::StepMode::same);
  EXPECT_EQ(residency.last_counts().misses, 3u);
  EXPECT_EQ(residency.last_counts().evictions, 3u);
  for (uint32_t i = 0; i < 3; ++i) {
    EXPECT_EQ(residency.find(4 + i), a[i]);
    EXPECT_EQ(residency.find(7 + i), b[i]);
    EXPECT_EQ(residency.find(1 + i), kNone);
  }
  // A page an earlier piece named is neither a hit nor a miss again.
  const std::vector<uint32_t> again = plan(residency, {5, 9}, gpu::StepMode::same);
  EXPECT_EQ(again[0], a[1]);
  EXPECT_EQ(again[1], b[2]);
  EXPECT_EQ(residency.last_counts().requested, 2u);
  EXPECT_EQ(residency.last_counts().hits + residency.last_counts().misses, 0u);
  EXPECT_TRUE(residency.moves().empty());
  // The step holds all six slots: a seventh page is refused, and the step's pages stay.
  const uint32_t extra = 10;
  uint32_t slot = 0;
  const gpu::Result r = residency.plan(&extra, 1, &slot, gpu::StepMode::same);
  EXPECT_FALSE(r.ok);
  EXPECT_NE(r.message.find("besides the 6 of its earlier pieces, more than the cache's 6 slots"),
            std::string::npos)
      << r.message;
  EXPECT_EQ(residency.find(10), kNone);
  EXPECT_EQ(residency.resident(), 6u);
  for (uint32_t i = 0; i < 3; ++i) EXPECT_EQ(residency.find(4 + i), a[i]);
  // A new step may evict them.
  plan(residency, {10, 7});
  EXPECT_EQ(residency.last_counts().hits, 1u);
  EXPECT_EQ(residency.last_counts().evictions, 1u);
  EXPECT_EQ(residency.find(7), b[0]);
}

TEST_P(Residency, pieces_of_a_step_agree_with_a_model_over_a_random_walk) {
  // Each step is planned in one to four pieces: every piece moves exactly its pages that are not
  // resident (an earlier piece's misses are resident), evicts no page of its step's pieces so far,
  // and the step's pieces count each distinct page once.
  gpu::PageResidency residency;
  constexpr uint32_t kCapacity = 96;
  ASSERT_OK(residency.init(kCapacity, 20000, GetParam()));
  std::mt19937 rng(31);
  std::map<uint32_t, uint32_t> model;
  std::vector<uint32_t> previous;
  for (int step = 0; step < 300; ++step) {
    std::vector<uint32_t> request;
    for (uint32_t id : previous)
      if (rng() % 5 != 0) request.push_back(id);
    const uint32_t fresh = 1 + rng() % 40;
    for (uint32_t i = 0; i < fresh; ++i) request.push_back(rng() % 600);
    std::set<uint32_t> distinct(request.begin(), request.end());
    if (distinct.size() > kCapacity)
      request.assign(distinct.begin(), std::next(distinct.begin(), kCapacity));
    for (std::size_t i = 0, d = request.size() / 6; i < d; ++i)
      request.push_back(request[rng() % request.size()]);
    std::shuffle(request.begin(), request.end(), rng);
    const std::set<uint32_t> step_pages(request.begin(), request.end());

    const uint32_t pieces = 1 + rng() % 4;
    std::vector<std::size_t> cuts = {0, request.size()};
    for (uint32_t k = 1; k < pieces; ++k) cuts.push_back(rng() % (request.size() + 1));
    std::sort(cuts.begin(), cuts.end());
    uint64_t counted = 0;
    std::vector<uint32_t> so_far;
    for (std::size_t k = 0; k + 1 < cuts.size(); ++k) {
      const std::vector<uint32_t> piece(request.begin() + cuts[k], request.begin() + cuts[k + 1]);
      so_far.insert(so_far.end(), piece.begin(), piece.end());
      const std::map<uint32_t, uint32_t> before = model;
      std::vector<uint32_t> slots(piece.size());
      ASSERT_OK(residency.plan(piece.data(), piece.size(), slots.data(),
                               k == 0 ? gpu::StepMode::next : gpu::StepMode::same));
      std::set<uint32_t> expected_moves, moved;
      for (uint32_t id : piece)
        if (!before.count(id)) expected_moves.insert(id);
      for (const gpu::PageMove& m : residency.moves())
        ASSERT_TRUE(moved.insert(m.host_slot).second) << "page " << m.host_slot << " moved twice";
      ASSERT_EQ(moved, expected_moves) << "step " << step << " piece " << k;
      ASSERT_NO_FATAL_FAILURE(apply_moves(residency, so_far, model, step));
      for (std::size_t i = 0; i < piece.size(); ++i) {
        ASSERT_EQ(slots[i], model.at(piece[i])) << "step " << step << " piece " << k;
        if (before.count(piece[i])) {
          ASSERT_EQ(slots[i], before.at(piece[i])) << "hit moved";
        }
      }
      counted += residency.last_counts().hits + residency.last_counts().misses;
    }
    ASSERT_EQ(counted, step_pages.size()) << "step " << step;
    for (uint32_t id : step_pages) ASSERT_NE(residency.find(id), kNone) << "step " << step;
    for (const auto& [host, device] : model) ASSERT_EQ(residency.find(host), device);
    ASSERT_EQ(residency.resident(), model.size());
    previous = request;
  }
}

INSTANTIATE_TEST_SUITE_P(Policies, Residency,
                         ::testing::Values(gpu::EvictionPolicy::lru, gpu::EvictionPolicy::clock),
                         [](const auto& info) {
                           return std::string(gpu::eviction_policy_name(info.param));
                         });

TEST(Residency, lru_evicts_the_least_recently_used_page) {
  gpu::PageResidency residency;
  ASSERT_OK(residency.init(3, 100, gpu::EvictionPolicy::lru));
  plan(residency, {1});
  plan(residency, {2});
  plan(residency, {3});
  plan(residency, {1});  // 2 is now the least recent
  const uint32_t slot_of_2 = residency.find(2);
  plan(residency, {4});
  EXPECT_EQ(residency.find(2), kNone);
  EXPECT_EQ(residency.find(4), slot_of_2);
  EXPECT_NE(residency.find(1), kNone);
  EXPECT_NE(residency.find(3), kNone);
}

TEST(Residency, clock_gives_used_pages_a_second_chance) {
  gpu::PageResidency residency;
  ASSERT_OK(residency.init(3, 100, gpu::EvictionPolicy::clock));
  plan(residency, {1, 2, 3});  // all referenced
  plan(residency, {4});        // the hand clears 1, 2, 3, then takes 1's slot
  EXPECT_EQ(residency.find(1), kNone);
  plan(residency, {2});  // 2 referenced again; 3 is not
  plan(residency, {5});  // the hand passes 2 (clearing it) and takes 3
  EXPECT_EQ(residency.find(3), kNone);
  EXPECT_NE(residency.find(2), kNone);
  EXPECT_NE(residency.find(4), kNone);
}

TEST(Residency, init_rejects_bad_sizes) {
  gpu::PageResidency residency;
  EXPECT_FALSE(residency.init(0, 100, gpu::EvictionPolicy::lru).ok);
  EXPECT_FALSE(residency.init(4, 0, gpu::EvictionPolicy::lru).ok);
  EXPECT_FALSE(residency.init(4, uint64_t{1} << 32, gpu::EvictionPolicy::clock).ok);
  std::vector<uint32_t> slots(1);
  const uint32_t id = 0;
  EXPECT_FALSE(residency.plan(&id, 1, slots.data()).ok);  // before init
}

TEST(PageCacheConfig, validate_names_the_bad_field) {
  alignas(16) static unsigned char pool[4096];
  gpu::PageCacheConfig good;
  good.slot_bytes = 1024;
  good.capacity = 2;
  good.host_pool = pool;
  good.host_slots = 4;
  EXPECT_TRUE(gpu::validate(good).ok);
  auto expect_invalid = [](gpu::PageCacheConfig c, const std::string& field) {
    const gpu::Result r = gpu::validate(c);
    EXPECT_FALSE(r.ok);
    EXPECT_NE(r.message.find(field), std::string::npos) << r.message;
  };
  gpu::PageCacheConfig c = good;
  c.slot_bytes = 1000;
  expect_invalid(c, "slot_bytes");
  c = good;
  c.capacity = 0;
  expect_invalid(c, "capacity");
  c = good;
  c.host_slots = 0;
  expect_invalid(c, "host_slots");
  c = good;
  c.host_pool = pool + 8;
  expect_invalid(c, "aligned");
  c = good;
  c.host_pool = nullptr;
  expect_invalid(c, "host_pool");
  c = good;
  c.staging_chunk_bytes = 1024;
  expect_invalid(c, "staging_chunk_bytes");
}

TEST(PageGather, copies_the_moved_pages_then_their_slots) {
  constexpr std::size_t kSlot = 64;
  std::vector<unsigned char> pool(10 * kSlot);
  std::iota(pool.begin(), pool.end(), 0);
  const std::vector<gpu::PageMove> moves = {{7, 0}, {2, 5}, {9, 1}};
  std::vector<unsigned char> staging(3 * kSlot + 3 * 4);
  gpu::gather_pages(pool.data(), kSlot, moves.data(), moves.size(), staging.data());
  for (std::size_t i = 0; i < moves.size(); ++i) {
    EXPECT_EQ(
        std::memcmp(staging.data() + i * kSlot, pool.data() + moves[i].host_slot * kSlot, kSlot),
        0);
    uint32_t slot = 0;
    std::memcpy(&slot, staging.data() + 3 * kSlot + 4 * i, 4);
    EXPECT_EQ(slot, moves[i].device_slot);
  }
}

#if KVSIFT_TEST_WITH_CUDA

class GpuTransferTest : public ::testing::Test {
 protected:
  void SetUp() override {
    int n_devices = 0;
    const gpu::Result r = gpu::device_count(&n_devices);
    if (!r.ok) GTEST_SKIP() << "no usable CUDA device: " << r.message;
    ASSERT_EQ(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), cudaSuccess);
  }
  void TearDown() override {
    if (stream_) cudaStreamDestroy(stream_);
  }
  cudaStream_t stream_ = nullptr;
};

// A host pool in mapped pinned memory (or pageable), filled with random bytes.
struct HostPool {
  std::size_t slot_bytes;
  uint64_t slots;
  bool pinned;
  unsigned char* data = nullptr;
  std::vector<unsigned char> pageable;

  HostPool(std::size_t slot_bytes_, uint64_t slots_, bool pinned_, uint32_t seed)
      : slot_bytes(slot_bytes_), slots(slots_), pinned(pinned_) {
    if (pinned) {
      void* p = nullptr;
      const gpu::Result r = gpu::pinned_alloc(slots * slot_bytes, &p);
      EXPECT_TRUE(r.ok) << r.message;
      data = static_cast<unsigned char*>(p);
    } else {
      pageable.resize(slots * slot_bytes + 16);
      data = pageable.data();
      data += (16 - reinterpret_cast<std::uintptr_t>(data) % 16) % 16;
    }
    std::mt19937 rng(seed);
    for (uint64_t s = 0; s < slots; ++s) rewrite(s, rng);
  }
  ~HostPool() {
    if (pinned) gpu::pinned_free(data);
  }
  void rewrite(uint64_t slot, std::mt19937& rng) {
    auto* words = reinterpret_cast<uint32_t*>(data + slot * slot_bytes);
    for (std::size_t i = 0; i < slot_bytes / 4; ++i) words[i] = static_cast<uint32_t>(rng());
  }
  const unsigned char* page(uint64_t slot) const { return data + slot * slot_bytes; }
};

struct TransferCase {
  gpu::TransferPath path;
  std::size_t slot_bytes;
  gpu::EvictionPolicy policy;
};

class GpuTransferCase : public GpuTransferTest,
                        public ::testing::WithParamInterface<TransferCase> {};

TEST_P(GpuTransferCase, device_pages_match_the_host_pages_they_were_loaded_from) {
  const TransferCase tc = GetParam();
  constexpr uint64_t kHostSlots = 700;
  constexpr uint32_t kCapacity = 160;
  HostPool host(tc.slot_bytes, kHostSlots, true, 17);
  gpu::PageCacheConfig config;
  config.slot_bytes = tc.slot_bytes;
  config.capacity = kCapacity;
  config.host_pool = host.data;
  config.host_slots = kHostSlots;
  config.policy = tc.policy;
  config.path = tc.path;
  config.mapped_below_bytes = 40 * tc.slot_bytes;            // automatic: both paths over the steps
  config.staging_chunk_bytes = 7 * (tc.slot_bytes + 4) + 3;  // 7 pages: several chunks, reused
  gpu::DevicePageCache cache;
  ASSERT_OK(cache.init(config));

  std::mt19937 rng(23 + static_cast<uint32_t>(tc.path) + static_cast<uint32_t>(tc.slot_bytes));
  // What each device slot must hold: the host page's bytes when it was loaded.
  std::vector<std::vector<unsigned char>> expected(kCapacity);
  std::vector<unsigned char> device(std::size_t{kCapacity} * tc.slot_bytes);
  std::vector<uint32_t> previous;
  std::set<uint32_t> rewritten;  // host pages changed since their device copy was made
  uint64_t total_misses = 0;
  for (int step = 0; step < 12; ++step) {
    // Part of the last step again, new pages, a duplicate; sizes from a handful to the capacity.
    std::vector<uint32_t> request;
    std::set<uint32_t> distinct;
    for (uint32_t id : previous)
      if (rng() % 3 != 0) request.push_back(id), distinct.insert(id);
    const std::size_t target = std::min<std::size_t>(
        kCapacity, distinct.size() + 1 + rng() % (step % 4 == 3 ? kCapacity : 50));
    while (distinct.size() < target) {
      const uint32_t id = rng() % kHostSlots;
      if (distinct.insert(id).second) request.push_back(id);
    }
    if (!request.empty()) request.push_back(request[rng() % request.size()]);
    std::shuffle(request.begin(), request.end(), rng);

    uint64_t expected_misses = 0;
    std::set<uint32_t> resident;
    for (uint32_t id : distinct) {
      if (cache.residency().find(id) == kNone)
        ++expected_misses;
      else
        resident.insert(id);
    }
    std::vector<uint32_t> slots(request.size(), 0xdeadbeef);
    // Odd steps plan and move in two calls, sending the resident pages rewritten since they were
    // loaded with the misses (the offload step's refreshes); even steps take ensure().
    std::vector<gpu::PageMove> extra;
    if (step % 2 == 1) {
      ASSERT_OK(cache.plan(request.data(), request.size(), slots.data()));
      for (std::size_t i = 0; i < request.size(); ++i)
        if (resident.count(request[i]) && rewritten.erase(request[i]))
          extra.push_back(gpu::PageMove{request[i], slots[i]});
      ASSERT_OK(cache.move(stream_, extra.data(), extra.size()));
    } else {
      ASSERT_OK(cache.ensure(request.data(), request.size(), slots.data(), stream_));
    }
    for (const gpu::PageMove& m : cache.residency().moves()) {
      expected[m.device_slot].assign(host.page(m.host_slot),
                                     host.page(m.host_slot) + tc.slot_bytes);
      rewritten.erase(m.host_slot);
    }
    for (const gpu::PageMove& m : extra)
      expected[m.device_slot].assign(host.page(m.host_slot),
                                     host.page(m.host_slot) + tc.slot_bytes);
    EXPECT_EQ(cache.last_step().misses, expected_misses) << "step " << step;
    EXPECT_EQ(cache.last_step().hits, distinct.size() - expected_misses);
    EXPECT_EQ(cache.last_step().bytes_moved, expected_misses * tc.slot_bytes);
    total_misses += expected_misses;

    ASSERT_EQ(cudaMemcpyAsync(device.data(), cache.device_pool(), device.size(),
                              cudaMemcpyDeviceToHost, stream_),
              cudaSuccess);
    ASSERT_EQ(cudaStreamSynchronize(stream_), cudaSuccess);
    for (std::size_t i = 0; i < request.size(); ++i) {
      ASSERT_LT(slots[i], kCapacity);
      ASSERT_EQ(expected[slots[i]].size(), tc.slot_bytes);
      ASSERT_EQ(std::memcmp(device.data() + slots[i] * tc.slot_bytes, expected[slots[i]].data(),
                            tc.slot_bytes),
                0)
          << "step " << step << ", host page " << request[i] << " in device slot " << slots[i];
    }
    // Rewrite some host pages, resident ones among them: a hit sent again would copy the new
    // bytes and fail the comparison above next step.
    for (int i = 0; i < 40; ++i) {
      const uint32_t id = rng() % kHostSlots;
      host.rewrite(id, rng);
      rewritten.insert(id);
    }
    previous.assign(distinct.begin(), distinct.end());
  }
  EXPECT_EQ(cache.totals().misses, total_misses);
  EXPECT_EQ(cache.totals().steps, 12u);
  if (tc.path == gpu::TransferPath::automatic) {
    EXPECT_GT(cache.totals().staged_steps, 0u);
    EXPECT_GT(cache.totals().mapped_steps, 0u);
  }
}

std::string transfer_case_name(const ::testing::TestParamInfo<TransferCase>& info) {
  return std::string(gpu::transfer_path_name(info.param.path)) + "_" +
         std::to_string(info.param.slot_bytes) + "_" + gpu::eviction_policy_name(info.param.policy);
}

INSTANTIATE_TEST_SUITE_P(
    Paths, GpuTransferCase,
    ::testing::Values(TransferCase{gpu::TransferPath::staged, 4096, gpu::EvictionPolicy::clock},
                      TransferCase{gpu::TransferPath::staged, 8192, gpu::EvictionPolicy::lru},
                      TransferCase{gpu::TransferPath::mapped, 4096, gpu::EvictionPolicy::lru},
                      TransferCase{gpu::TransferPath::mapped, 8192, gpu::EvictionPolicy::clock},
                      TransferCase{gpu::TransferPath::automatic, 8192, gpu::EvictionPolicy::clock},
                      TransferCase{gpu::TransferPath::staged, 16, gpu::EvictionPolicy::lru},
                      TransferCase{gpu::TransferPath::mapped, 16, gpu::EvictionPolicy::clock},
                      // A q8 slot (simd/page_layout.hpp: 2 * 16 * 128 codes + 8 * 16 scale
                      // bytes) is no power of two; the 2176-byte one ends mid-CTA range.
                      TransferCase{gpu::TransferPath::staged, 4224, gpu::EvictionPolicy::lru},
                      TransferCase{gpu::TransferPath::mapped, 4224, gpu::EvictionPolicy::clock},
                      TransferCase{gpu::TransferPath::mapped, 2176, gpu::EvictionPolicy::lru}),
    transfer_case_name);

TEST_F(GpuTransferTest, staged_path_reads_a_pageable_pool_and_mapped_refuses_it) {
  HostPool host(4096, 50, false, 3);
  gpu::PageCacheConfig config;
  config.slot_bytes = 4096;
  config.capacity = 8;
  config.host_pool = host.data;
  config.host_slots = 50;
  config.path = gpu::TransferPath::mapped;
  gpu::DevicePageCache cache;
  const gpu::Result refused = cache.init(config);
  EXPECT_FALSE(refused.ok);
  EXPECT_NE(refused.message.find("mapped pinned memory"), std::string::npos) << refused.message;

  config.path = gpu::TransferPath::automatic;
  config.mapped_below_bytes = std::size_t{1} << 30;  // would take mapped if it could
  ASSERT_OK(cache.init(config));
  const std::vector<uint32_t> ids = {3, 49, 0};
  std::vector<uint32_t> slots(3);
  ASSERT_OK(cache.ensure(ids.data(), ids.size(), slots.data(), stream_));
  EXPECT_EQ(cache.last_step().staged_steps, 1u);
  std::vector<unsigned char> page(4096);
  for (std::size_t i = 0; i < ids.size(); ++i) {
    ASSERT_EQ(cudaMemcpy(page.data(),
                         static_cast<const unsigned char*>(cache.device_pool()) + slots[i] * 4096,
                         4096, cudaMemcpyDeviceToHost),
              cudaSuccess);
    EXPECT_EQ(std::memcmp(page.data(), host.page(ids[i]), 4096), 0) << "page " << ids[i];
  }
  const gpu::Result r =
      cache.ensure(ids.data(), ids.size(), slots.data(), stream_, gpu::TransferPath::mapped);
  EXPECT_FALSE(r.ok);
}

TEST_F(GpuTransferTest, refuses_bad_ids_and_oversized_steps_then_carries_on) {
  HostPool host(1024, 64, true, 5);
  gpu::PageCacheConfig config;
  config.slot_bytes = 1024;
  config.capacity = 4;
  config.host_pool = host.data;
  config.host_slots = 64;
  gpu::DevicePageCache cache;
  ASSERT_OK(cache.init(config));
  std::vector<uint32_t> slots(8);
  const std::vector<uint32_t> bad = {1, 64};
  gpu::Result r = cache.ensure(bad.data(), bad.size(), slots.data(), stream_);
  EXPECT_FALSE(r.ok);
  EXPECT_FALSE(r.unsupported);
  EXPECT_NE(r.message.find("host slot 64 at index 1"), std::string::npos) << r.message;
  const std::vector<uint32_t> big = {1, 2, 3, 4, 5};
  r = cache.ensure(big.data(), big.size(), slots.data(), stream_);
  EXPECT_FALSE(r.ok);
  EXPECT_NE(r.message.find("needs 5 distinct pages, more than the cache's 4 slots"),
            std::string::npos)
      << r.message;
  EXPECT_EQ(cache.totals().steps, 0u);
  const std::vector<uint32_t> fine = {5, 1, 2, 3};
  ASSERT_OK(cache.ensure(fine.data(), fine.size(), slots.data(), stream_));
  EXPECT_EQ(cache.last_step().misses, 4u);
  // plan() and move(): one move per plan, extra moves inside the pools and the capacity; a
  // refused move ends its plan and forgets its misses.
  r = cache.move(stream_);
  EXPECT_FALSE(r.ok);
  EXPECT_NE(r.message.find("without a plan()"), std::string::npos) << r.message;
  ASSERT_OK(cache.plan(fine.data(), fine.size(), slots.data()));
  const gpu::PageMove outside[] = {{5, slots[0]}, {64, slots[1]}};
  r = cache.move(stream_, outside, 2);
  EXPECT_FALSE(r.ok);
  EXPECT_NE(r.message.find("extra move 1 (host slot 64"), std::string::npos) << r.message;
  r = cache.move(stream_, outside, 1);
  EXPECT_FALSE(r.ok) << "a refused move() ended its plan";
  const std::vector<uint32_t> other = {5, 1, 2, 6};  // 6 is new: a miss, forgotten when refused
  ASSERT_OK(cache.plan(other.data(), other.size(), slots.data()));
  EXPECT_EQ(cache.residency().moves().size(), 1u);
  const gpu::PageMove too_many[] = {{5, 0}, {1, 1}, {2, 2}, {3, 3}};
  r = cache.move(stream_, too_many, 4);
  EXPECT_FALSE(r.ok);
  EXPECT_NE(r.message.find("more than the cache's 4 slots"), std::string::npos) << r.message;
  EXPECT_EQ(cache.residency().find(6), kNone);
  ASSERT_OK(cache.plan(other.data(), other.size(), slots.data()));
  ASSERT_OK(cache.move(stream_, outside, 1));  // page 5 sent again with the miss
  EXPECT_EQ(cache.last_step().misses, 1u);
  EXPECT_EQ(cache.last_step().mapped_steps + cache.last_step().staged_steps, 1u);
  r = cache.move(stream_);
  EXPECT_FALSE(r.ok) << "a second move() for one plan()";
  ASSERT_EQ(cudaStreamSynchronize(stream_), cudaSuccess);
}

#else  // a build without CUDA

TEST(GpuPageCache, needs_a_cuda_build) {
  alignas(16) static unsigned char pool[1024];
  gpu::PageCacheConfig config;
  config.slot_bytes = 256;
  config.capacity = 2;
  config.host_pool = pool;
  config.host_slots = 4;
  gpu::DevicePageCache cache;
  const gpu::Result r = cache.init(config);
  EXPECT_TRUE(r.unsupported) << r.message;
  GTEST_SKIP() << "kvsift was built without CUDA (KVSIFT_ENABLE_CUDA=OFF): " << r.message;
}

#endif

}  // namespace
