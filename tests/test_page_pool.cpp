#include <gtest/gtest.h>

#include <set>

#include "lib/cache/page_pool.hpp"
#include "lib/core/error.hpp"

using namespace kvsift;

TEST(PagePool, hands_out_distinct_aligned_slots_up_to_capacity) {
  PagePool pool(4096, 8, false);
  pool.reserve(8, "test");
  std::set<uint32_t> ids;
  for (int i = 0; i < 8; ++i) {
    const uint32_t id = pool.acquire();
    EXPECT_TRUE(ids.insert(id).second);
    EXPECT_EQ(reinterpret_cast<std::uintptr_t>(pool.slot(id)) % 64, 0u);
  }
  EXPECT_EQ(pool.in_use(), 8u);
  EXPECT_EQ(pool.available(), 0u);
  try {
    pool.reserve(1, "append");
    FAIL() << "reserve past capacity did not throw";
  } catch (const Error& e) {
    EXPECT_EQ(e.status(), Status::capacity_exceeded);
    EXPECT_NE(std::string(e.what()).find("max_pages"), std::string::npos);
  }
}

TEST(PagePool, released_slots_are_reused_last_in_first_out) {
  PagePool pool(128, 4, false);
  pool.reserve(3, "test");
  const uint32_t a = pool.acquire(), b = pool.acquire(), c = pool.acquire();
  pool.release(b);
  pool.release(a);
  EXPECT_EQ(pool.in_use(), 1u);
  pool.reserve(2, "test");
  EXPECT_EQ(pool.acquire(), a);
  EXPECT_EQ(pool.acquire(), b);
  EXPECT_EQ(pool.high_water(), 3u);
  (void)c;
}

TEST(PagePool, rejects_zero_and_overflowing_sizes) {
  EXPECT_THROW(PagePool(0, 4, false), Error);
  EXPECT_THROW(PagePool(100, 4, false), Error);  // not a multiple of 64
  EXPECT_THROW(PagePool(4096, 0, false), Error);
  EXPECT_THROW(PagePool(uint64_t{1} << 40, uint64_t{1} << 31, false), Error);
}

TEST(PagePool, large_reservations_commit_memory_only_when_touched) {
  // 64 GiB of address space on a 24 GiB machine: fine, because pages commit on first write.
  PagePool pool(65536, 1 << 20, false);
  pool.reserve(1, "test");
  pool.slot(pool.acquire())[0] = std::byte{1};
  EXPECT_EQ(pool.region().size(), (uint64_t{1} << 20) * 65536);
}
