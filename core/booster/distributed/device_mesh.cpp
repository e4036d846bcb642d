#include "booster/distributed/device_mesh.h"

#include "booster/common/error.h"

namespace booster::distributed {

std::string mesh_size_problem(int world_size, int tp_size, int pp_size) {
  if (tp_size >= 1 && pp_size >= 1 && world_size % (tp_size * pp_size) == 0) return "";
  std::string fits;
  for (int tp = 1; tp <= world_size; ++tp)
    for (int pp = 1; tp * pp <= world_size; ++pp)
      if (world_size % (tp * pp) == 0) fits += (fits.empty() ? "" : ", ") + std::to_string(tp) + "x" + std::to_string(pp);
  // The usual mistake is a grid larger than the job (booster train without booster run): say how to start it.
  const int replica = tp_size * pp_size;
  const std::string start = world_size < replica ? "; or start " + std::to_string(replica) +
                                                       " processes (a multiple for data parallel): booster run -n " +
                                                       std::to_string(replica) + " -- booster train ..."
                                                 : std::string();
  return "tp_size " + std::to_string(tp_size) + " x pp_size " + std::to_string(pp_size) +
         " does not divide the world size " + std::to_string(world_size) + " (data parallel takes the rest); " +
         "tp_size x pp_size pairs that fit: " + fits + start;
}

DeviceMesh::DeviceMesh(ProcessGroup& world, int tp_size, int pp_size)
    : tp_size_(tp_size), pp_size_(pp_size), world_(&world) {
  const std::string problem = mesh_size_problem(world.size(), tp_size, pp_size);
  BOOSTER_CHECK(problem.empty(), ConfigError, problem);
  dp_size_ = world.size() / (tp_size * pp_size);
  coord_ = coord_of(world.rank());
  // Color: the coordinates the group shares; key: the one it varies along.
  tp_ = world.split(coord_.dp * pp_size_ + coord_.pp, coord_.tp, "tp");
  pp_ = world.split(coord_.dp * tp_size_ + coord_.tp, coord_.pp, "pp");
  dp_ = world.split(coord_.pp * tp_size_ + coord_.tp, coord_.dp, "dp");
}

MeshCoord DeviceMesh::coord_of(int rank) const {
  return {rank / (tp_size_ * pp_size_), (rank / tp_size_) % pp_size_, rank % tp_size_};
}

int DeviceMesh::rank_of(const MeshCoord& c) const { return (c.dp * pp_size_ + c.pp) * tp_size_ + c.tp; }

}  // namespace booster::distributed
