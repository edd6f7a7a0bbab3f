#include "kvshard/comm/groups.h"

namespace kvshard {

ParallelGroups make_groups(Communicator& world, const ParallelConfig& p) {
    require(p.dp >= 1 && p.pp >= 1 && p.cp >= 1 && p.tp >= 1 && p.ep >= 1,
            "make_groups: every parallel degree must be >= 1, got ", p.to_string());
    require(world.size() == p.world_size(), "make_groups: ", p.to_string(), " needs ",
            p.world_size(), " ranks (dp*pp*cp*tp) but the communicator has ", world.size());
    require(p.stage_size() % p.ep == 0, "make_groups: ep=", p.ep,
            " must divide the ranks of a pipeline stage (dp*cp*tp = ", p.stage_size(), ")");
    ParallelGroups g;
    const RankCoord c = rank_coord(p, world.rank());
    g.coord = c;
    // Color: the rank with the varying coordinate set to 0 (unique per group); key: the coordinate.
    g.tp = world.split(rank_of(p, c.dp, c.pp, c.cp, 0), c.tp);
    g.cp = world.split(rank_of(p, c.dp, c.pp, 0, c.tp), c.cp);
    g.pp = world.split(rank_of(p, c.dp, 0, c.cp, c.tp), c.pp);
    g.dp = world.split(rank_of(p, 0, c.pp, c.cp, c.tp), c.dp);
    g.ep = world.split(c.pp * (p.stage_size() / p.ep) + c.ep_group, c.ep);
    const int local = (c.dp * p.cp + c.cp) * p.tp + c.tp;
    g.stage = world.split(c.pp, local);
    g.replica = world.split(c.dp, world.rank());
    return g;
}

}  // namespace kvshard
