// The C handle behind kvsift_cache, shared by the C boundary's files (capi.cpp: the cache and
// attention; select_capi.cpp: selection without attention). The decode step lives in the engine
// (lib/engine/decode_engine.hpp); the handle only pairs it with its cache.
#pragma once

#include "lib/cache/kv_cache.hpp"
#include "lib/core/kernel_runtime.hpp"
#include "lib/engine/decode_engine.hpp"

struct kvsift_cache {
  kvsift_cache(const kvsift::CacheGeometry& geometry, const kvsift::CacheOptions& options,
               kvsift::simd::Level level, const kvsift::EngineOptions& engine_options)
      : runtime(level),
        cache(geometry, options, runtime.kernels()),
        engine(cache, runtime.kernels(), engine_options) {}

  // The handle's kernel level, chosen once; the cache and the engine run its tables.
  kvsift::KernelRuntime runtime;
  kvsift::KvCache cache;
  // After the cache, which its selector and offload backend listen to (and leave before it goes).
  kvsift::DecodeEngine engine;
};
