#pragma once
// The sub-communicators of one rank, built from the layout's rank order (parallel_config.h):
//   rank = ((dp * pp_size + pp) * cp_size + cp) * tp_size + tp;  EP groups are `ep` consecutive
//   ranks of a stage's local numbering local = (dp * cp_size + cp) * tp_size + tp.
// In every group, a rank's index equals its coordinate along that dimension (tp group: rank() ==
// coord.tp, and so on; ep group: rank() == coord.ep).
#include <memory>

#include "kvshard/comm/communicator.h"
#include "kvshard/layout/parallel_config.h"

namespace kvshard {

struct ParallelGroups {
    RankCoord coord;                      // this rank's coordinates
    std::unique_ptr<Communicator> tp;     // same (dp, pp, cp): tp_size ranks, all-reduce per layer
    std::unique_ptr<Communicator> cp;     // same (dp, pp, tp): cp_size ranks, the KV ring
    std::unique_ptr<Communicator> pp;     // same (dp, cp, tp): pp_size ranks, activations hand-off
    std::unique_ptr<Communicator> dp;     // same (pp, cp, tp): dp_size replicas
    std::unique_ptr<Communicator> ep;     // same pp stage and ep_group: ep_size ranks, all-to-all
    std::unique_ptr<Communicator> stage;  // same pp: the dp*cp*tp ranks of this pipeline stage,
                                          // ranked by local index
    std::unique_ptr<Communicator> replica;  // same dp: the pp*cp*tp ranks of one model replica,
                                            // ranked by rank order
};

// Collective over `world`: every rank calls it with the same config. Throws Error when
// world.size() != p.world_size() or when ep does not divide the stage size (dp*cp*tp).
ParallelGroups make_groups(Communicator& world, const ParallelConfig& p);

}  // namespace kvshard
