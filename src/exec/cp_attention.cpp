#include "kvshard/exec/cp_attention.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "attention/vec.h"
#include "kvshard/common/error.h"

namespace kvshard {

namespace {
// Eight independent partial sums, so the compiler can vectorise without reassociating one sum.
inline float dot(const float* a, const float* b, int n) {
    float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    int x = 0;
    for (; x + 8 <= n; x += 8)
        for (int l = 0; l < 8; ++l) acc[l] += a[x + l] * b[x + l];
    float s = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
    for (; x < n; ++x) s += a[x] * b[x];
    return s;
}
}  // namespace

int64_t cp_first_visible(const CpAttnShape& s, int64_t pos) {
    if (s.window <= 0) return 0;
    return s.chunked ? pos - pos % s.window : std::max<int64_t>(0, pos - s.window + 1);
}

void cp_partial_attention(const CpAttnShape& s, const float* q, std::span<const int64_t> q_pos,
                          const float* k, const float* v, std::span<const int64_t> kv_pos,
                          float* out, float* lse) {
    KVSHARD_CHECK(s.num_kv_heads >= 1 && s.num_q_heads % s.num_kv_heads == 0, "query heads ",
                  s.num_q_heads, " not a multiple of KV heads ", s.num_kv_heads);
    const int hq = s.num_q_heads, hkv = s.num_kv_heads, d = s.head_dim;
    const int group = hq / hkv;
    const int64_t nq = static_cast<int64_t>(q_pos.size());
    const int64_t nk = static_cast<int64_t>(kv_pos.size());
    constexpr float kNegInf = -std::numeric_limits<float>::infinity();
    if (group <= 16 && std::is_sorted(kv_pos.begin(), kv_pos.end())) {
        // Keys in ascending position (every shard of the ring): the keys a query sees are a prefix.
        // It is walked in tiles of `tile` tokens, every KV head of a tile in turn (a tile of K, and
        // one of V, is contiguous bytes), through the vectorised online-softmax step. One query row
        // (decode) streams K and V from memory once: 16-key tiles, and each step prefetches into
        // L2 its share of the tile two further on. Many rows (prefill) find the keys in cache:
        // 64-key tiles (fewer softmax rescales), no prefetch.
        const int64_t tile = nq > 1 ? 64 : 16, ahead_tiles = nq > 1 ? 1 : 2;
        const vec::Ops& V = vec::ops();
        const int64_t kv_stride = int64_t{hkv} * d;
        const int64_t tile_bytes = tile * kv_stride * static_cast<int64_t>(sizeof(float));
        const int slice_lines = static_cast<int>(tile_bytes / hkv / 64);
        std::vector<float> m(hq), l(hq);
        for (int64_t i = 0; i < nq; ++i) {
            const int64_t nvis =
                std::upper_bound(kv_pos.begin(), kv_pos.end(), q_pos[i]) - kv_pos.begin();
            const int64_t jlo = std::min<int64_t>(
                nvis,
                std::lower_bound(kv_pos.begin(), kv_pos.end(), cp_first_visible(s, q_pos[i])) -
                    kv_pos.begin());
            float* o = out + i * hq * d;
            std::fill(o, o + int64_t{hq} * d, 0.0f);
            std::fill(m.begin(), m.end(), kNegInf);
            std::fill(l.begin(), l.end(), 0.0f);
            for (int64_t j0 = jlo; j0 < nvis; j0 += tile) {
                const int nv = static_cast<int>(std::min<int64_t>(tile, nvis - j0));
                const int64_t ahead = j0 + ahead_tiles * tile;
                for (int kh = 0; kh < hkv; ++kh) {
                    vec::Ops::Prefetch pf;
                    if (nq == 1 && ahead + tile <= nvis) {
                        const int64_t off =
                            ahead * kv_stride * static_cast<int64_t>(sizeof(float)) +
                            kh * (tile_bytes / hkv);
                        pf = {reinterpret_cast<const char*>(k) + off,
                              reinterpret_cast<const char*>(v) + off, slice_lines};
                    }
                    const int64_t row0 = int64_t{kh} * group;
                    V.attend_keys(q + (i * hq + row0) * d, group, d,
                                  k + j0 * kv_stride + int64_t{kh} * d,
                                  v + j0 * kv_stride + int64_t{kh} * d, nv, kv_stride, d, s.scale,
                                  m.data() + row0, l.data() + row0, o + row0 * d, pf);
                }
            }
            for (int h = 0; h < hq; ++h) {
                float* oh = o + int64_t{h} * d;
                if (nvis == jlo) {  // no visible key: weight 0 in any merge
                    std::fill(oh, oh + d, 0.0f);
                    lse[i * hq + h] = kNegInf;
                    continue;
                }
                const float inv = 1.0f / l[h];
                for (int x = 0; x < d; ++x) oh[x] *= inv;
                lse[i * hq + h] = m[h] + std::log(l[h]);
            }
        }
        return;
    }
    // score[g * nk + j]: query head kh * group + g against key j. The heads of one KV head share
    // each loaded key and value row.
    std::vector<float> score(static_cast<size_t>(nk) * group);
    std::vector<float> m(group), sum(group);
    for (int64_t i = 0; i < nq; ++i) {
        const int64_t qp = q_pos[i], qlo = cp_first_visible(s, qp);
        for (int kh = 0; kh < hkv; ++kh) {
            const float* qr = q + (i * hq + int64_t{kh} * group) * d;
            std::fill(m.begin(), m.end(), kNegInf);
            for (int64_t j = 0; j < nk; ++j) {
                const bool visible = kv_pos[j] <= qp && kv_pos[j] >= qlo;
                const float* kr = k + (j * hkv + kh) * d;
                for (int g = 0; g < group; ++g) {
                    const float sc = visible ? dot(qr + int64_t{g} * d, kr, d) * s.scale : kNegInf;
                    score[g * nk + j] = sc;
                    m[g] = std::max(m[g], sc);
                }
            }
            float* o = out + (i * hq + int64_t{kh} * group) * d;
            std::fill(o, o + int64_t{group} * d, 0.0f);
            std::fill(sum.begin(), sum.end(), 0.0f);
            for (int64_t j = 0; j < nk; ++j) {
                if (kv_pos[j] > qp || kv_pos[j] < qlo) continue;
                const float* vr = v + (j * hkv + kh) * d;
                for (int g = 0; g < group; ++g) {
                    const float w = std::exp(score[g * nk + j] - m[g]);
                    sum[g] += w;
                    float* og = o + int64_t{g} * d;
                    for (int x = 0; x < d; ++x) og[x] += w * vr[x];
                }
            }
            for (int g = 0; g < group; ++g) {
                float* og = o + int64_t{g} * d;
                float& l = lse[i * hq + int64_t{kh} * group + g];
                if (m[g] == kNegInf) {  // no visible key: weight 0 in any merge
                    l = kNegInf;
                    continue;
                }
                const float inv = 1.0f / sum[g];
                for (int x = 0; x < d; ++x) og[x] *= inv;
                l = m[g] + std::log(sum[g]);
            }
        }
    }
}

}  // namespace kvshard
