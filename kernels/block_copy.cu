// Batched copy of KV-cache blocks between an engine's paged cache and kvstore slots.
//
// Compiled at run time with NVRTC (CuPy RawModule) from this file, which ships in the
// package; it needs no headers so that NVRTC and nvcc both take it as is.
//
// A block is `n_segs` segments of `seg_vecs` vectors each.  For the block of page `p`,
// segment `s` lives in the engine cache at  seg_base[s] + p * seg_stride[s]  (bytes), and
// in slot `b` at  slot_base[b] + s * seg_vecs * sizeof(V).  A segment is one layer's K and
// V (per-layer caches), one layer's K or V (K/V-split caches) or a whole page (all-layer
// staging): the host side builds the table, the kernel only moves bytes.
//
// All tables travel in one int64 array, so a launch needs a single small upload:
//   meta = [seg_base[n_segs], seg_stride[n_segs], page_ids[n_blocks], slot_base[n_blocks]]
//
// Grid: x walks the chunks of a segment, y the segments, z the blocks; each dimension
// strides, so any batch fits the launch limits.  V is the widest vector (16, 8, 4 or 1
// bytes) that every address, stride and segment size is a multiple of; the host picks it.

#define KV_THREADS 256
#define KV_UNROLL 4

struct alignas(16) kv_vec16 { unsigned long long lo, hi; };
struct alignas(8) kv_vec8 { unsigned long long v; };
struct alignas(4) kv_vec4 { unsigned int v; };
struct kv_vec1 { unsigned char v; };

template <typename V>
__device__ __forceinline__ void copy_segment(const V* __restrict__ src, V* __restrict__ dst,
                                             long long n_vec) {
    const long long per_cta = (long long)blockDim.x * KV_UNROLL;
    for (long long base = (long long)blockIdx.x * per_cta; base < n_vec;
         base += (long long)gridDim.x * per_cta) {
        // All loads first, then all stores: KV_UNROLL independent loads in flight per thread.
        V r[KV_UNROLL];
        if (base + per_cta <= n_vec) {
#pragma unroll
            for (int u = 0; u < KV_UNROLL; ++u) r[u] = src[base + threadIdx.x + u * blockDim.x];
#pragma unroll
            for (int u = 0; u < KV_UNROLL; ++u) dst[base + threadIdx.x + u * blockDim.x] = r[u];
        } else {
#pragma unroll
            for (int u = 0; u < KV_UNROLL; ++u) {
                const long long i = base + threadIdx.x + (long long)u * blockDim.x;
                if (i < n_vec) r[u] = src[i];
            }
#pragma unroll
            for (int u = 0; u < KV_UNROLL; ++u) {
                const long long i = base + threadIdx.x + (long long)u * blockDim.x;
                if (i < n_vec) dst[i] = r[u];
            }
        }
    }
}

template <typename V, bool GATHER>
__device__ __forceinline__ void copy_blocks(const long long* __restrict__ meta, int n_segs,
                                            long long seg_vecs, int n_blocks) {
    const long long* seg_base = meta;
    const long long* seg_stride = meta + n_segs;
    const long long* page_ids = meta + 2 * (long long)n_segs;
    const long long* slot_base = page_ids + n_blocks;
    for (int b = blockIdx.z; b < n_blocks; b += gridDim.z) {
        const long long page = page_ids[b];
        char* slot = reinterpret_cast<char*>(static_cast<unsigned long long>(slot_base[b]));
        for (int s = blockIdx.y; s < n_segs; s += gridDim.y) {
            char* paged = reinterpret_cast<char*>(
                static_cast<unsigned long long>(seg_base[s] + page * seg_stride[s]));
            V* slot_seg = reinterpret_cast<V*>(slot) + (long long)s * seg_vecs;
            if (GATHER) {
                copy_segment<V>(reinterpret_cast<const V*>(paged), slot_seg, seg_vecs);
            } else {
                copy_segment<V>(slot_seg, reinterpret_cast<V*>(paged), seg_vecs);
            }
        }
    }
}

#define KV_DEFINE(width)                                                                  \
    extern "C" __global__ void __launch_bounds__(KV_THREADS)                              \
        kv_gather_v##width(const long long* __restrict__ meta, int n_segs,                \
                           long long seg_vecs, int n_blocks) {                            \
        copy_blocks<kv_vec##width, true>(meta, n_segs, seg_vecs, n_blocks);               \
    }                                                                                     \
    extern "C" __global__ void __launch_bounds__(KV_THREADS)                              \
        kv_scatter_v##width(const long long* __restrict__ meta, int n_segs,               \
                            long long seg_vecs, int n_blocks) {                           \
        copy_blocks<kv_vec##width, false>(meta, n_segs, seg_vecs, n_blocks);              \
    }

KV_DEFINE(16)
KV_DEFINE(8)
KV_DEFINE(4)
KV_DEFINE(1)
