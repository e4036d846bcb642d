// DeviceMesh: the ranks of a hybrid-parallel job as a 3-D grid, dp x pp x tp, and this rank's group
// along each axis. Tensor parallelism is innermost, so the ranks of a tensor-parallel group are
// consecutive (on one node under a block placement), then pipeline stages, then data-parallel
// replicas, as Megatron-LM orders them: rank = (dp * pp_size + pp) * tp_size + tp.
#pragma once

#include <memory>
#include <string>

#include "booster/distributed/process_group.h"

namespace booster::distributed {

struct MeshCoord {
  int dp = 0, pp = 0, tp = 0;
  bool operator==(const MeshCoord&) const = default;
};

class DeviceMesh {
 public:
  // Collective over `world`: every rank calls it with the same sizes, and gets its tensor-, pipeline-
  // and data-parallel groups (made with ProcessGroup::split, in that order). dp_size is
  // world.size() / (tp_size * pp_size); ConfigError when that does not divide, listing the
  // tp_size x pp_size pairs that fit the world size.
  DeviceMesh(ProcessGroup& world, int tp_size, int pp_size);

  int tp_size() const { return tp_size_; }
  int pp_size() const { return pp_size_; }
  int dp_size() const { return dp_size_; }
  // This rank's place in the grid.
  const MeshCoord& coord() const { return coord_; }
  // Between ranks of the world group and grid coordinates.
  MeshCoord coord_of(int rank) const;
  int rank_of(const MeshCoord& c) const;

  // The group the mesh was made from (it must outlive the mesh): the whole job, on the model's device.
  ProcessGroup& world() const { return *world_; }
  // The ranks that differ from this one only along that axis; a group's rank is the coordinate.
  ProcessGroup& tp_group() const { return *tp_; }
  ProcessGroup& pp_group() const { return *pp_; }
  ProcessGroup& dp_group() const { return *dp_; }

 private:
  int tp_size_, pp_size_, dp_size_;
  MeshCoord coord_;
  ProcessGroup* world_;
  std::shared_ptr<ProcessGroup> tp_, pp_, dp_;
};

// The ConfigError text when tp_size * pp_size does not divide world_size (empty when it does).
std::string mesh_size_problem(int world_size, int tp_size, int pp_size);

}  // namespace booster::distributed
