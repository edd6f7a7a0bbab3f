#pragma once
// Stand-in for the BlockManager until it lands: sequential allocation, no prefix cache.
#include <algorithm>
#include <cstdint>
#include <map>
#include <span>
#include <vector>

#include "kvshard/cache/paged_kv.h"
#include "kvshard/common/error.h"

namespace kvshard {

struct SimpleAlloc {
    int64_t cached_tokens = 0;
};

class SimpleBlockTables {
  public:
    SimpleBlockTables(int64_t num_blocks, int block_size)
        : num_blocks_(num_blocks), bs_(block_size) {}
    SimpleAlloc allocate(int64_t seq, std::span<const int32_t> tokens) {
        auto& s = seqs_[seq];
        s.tokens = 0;
        grow(s, int64_t(tokens.size()));
        return {};
    }
    void append(int64_t seq, std::span<const int32_t> tokens) {
        grow(seqs_.at(seq), int64_t(tokens.size()));
    }
    std::span<const int32_t> block_table(int64_t seq) const { return seqs_.at(seq).blocks; }
    int64_t num_tokens(int64_t seq) const { return seqs_.at(seq).tokens; }
    PagedKv paged_kv(std::span<const int64_t> seqs) const {
        PagedKv kv;
        for (int64_t s : seqs) kv.add_sequence(seqs_.at(s).blocks, seqs_.at(s).tokens, bs_);
        return kv;
    }
    int64_t hit_tokens() const { return 0; }

  private:
    struct Seq {
        std::vector<int32_t> blocks;
        int64_t tokens = 0;
    };
    void grow(Seq& s, int64_t n) {
        s.tokens += n;
        while (int64_t(s.blocks.size()) * bs_ < s.tokens) {
            require(next_ < num_blocks_, "out of KV blocks: ", num_blocks_, " blocks of ", bs_,
                    " tokens");
            s.blocks.push_back(int32_t(next_++));
        }
    }
    int64_t num_blocks_;
    int bs_;
    int64_t next_ = 0;
    std::map<int64_t, Seq> seqs_;
};

}  // namespace kvshard
