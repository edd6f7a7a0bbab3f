#include "kvshard/exec/cp_attention.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "kvshard/common/error.h"

namespace kvshard {

void cp_partial_attention(const CpAttnShape& s, const float* q, std::span<const int64_t> q_pos,
                          const float* k, const float* v, std::span<const int64_t> kv_pos,
                          float* out, float* lse) {
    KVSHARD_CHECK(s.num_kv_heads >= 1 && s.num_q_heads % s.num_kv_heads == 0, "query heads ",
                  s.num_q_heads, " not a multiple of KV heads ", s.num_kv_heads);
    const int hq = s.num_q_heads, hkv = s.num_kv_heads, d = s.head_dim;
    const int group = hq / hkv;
    const int64_t nq = static_cast<int64_t>(q_pos.size());
    const int64_t nk = static_cast<int64_t>(kv_pos.size());
    std::vector<float> score(static_cast<size_t>(nk));
    for (int64_t i = 0; i < nq; ++i) {
        const int64_t qp = q_pos[i];
        for (int h = 0; h < hq; ++h) {
            const float* qr = q + (i * hq + h) * d;
            float* o = out + (i * hq + h) * d;
            const int kh = h / group;
            float m = -std::numeric_limits<float>::infinity();
            for (int64_t j = 0; j < nk; ++j) {
                if (kv_pos[j] > qp) {
                    score[j] = -std::numeric_limits<float>::infinity();
                    continue;
                }
                const float* kr = k + (j * hkv + kh) * d;
                float dot = 0.0f;
                for (int x = 0; x < d; ++x) dot += qr[x] * kr[x];
                score[j] = dot * s.scale;
                m = std::max(m, score[j]);
            }
            std::fill(o, o + d, 0.0f);
            if (m == -std::numeric_limits<float>::infinity()) {
                lse[i * hq + h] = m;
                continue;
            }
            float sum = 0.0f;
            for (int64_t j = 0; j < nk; ++j) {
                if (kv_pos[j] > qp) continue;
                const float w = std::exp(score[j] - m);
                sum += w;
                const float* vr = v + (j * hkv + kh) * d;
                for (int x = 0; x < d; ++x) o[x] += w * vr[x];
            }
            const float inv = 1.0f / sum;
            for (int x = 0; x < d; ++x) o[x] *= inv;
            lse[i * hq + h] = m + std::log(sum);
        }
    }
}

}  // namespace kvshard
