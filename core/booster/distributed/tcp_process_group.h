// The "tcp" backend of ProcessGroup: CPU tensors over plain TCP sockets, for jobs started without MPI
// (torchrun's RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT), as PyTorch's Gloo backend serves them.
// Note [TCP process group] in this folder's README.md: the bootstrap, the full mesh, the worker thread
// that moves every frame, the ring collectives, timeouts and failing peers.
#pragma once

#include <chrono>
#include <memory>

#include "booster/distributed/process_group.h"
#include "booster/distributed/rendezvous.h"

namespace booster::distributed {

// A group over `world_size` processes that meet through `spec` (rendezvous.h): backend "tcp", device
// cpu. Every rank calls it once; it returns when this rank is connected to every other. Rank 0 listens
// at MASTER_ADDR:MASTER_PORT (Kind::Tcp: ConfigError when that address is not this machine's or the
// port is in use) or on a port it hands out through the file (Kind::File). DistributedError naming the
// ranks that did not connect within `connect_timeout`; ConfigError for a peer with another world size
// or two processes with one rank. Several groups may live in one process (each with its own sockets
// and worker thread).
std::shared_ptr<ProcessGroup> make_tcp_process_group(int rank, int world_size, const RendezvousSpec& spec,
                                                     std::chrono::duration<double> connect_timeout);

}  // namespace booster::distributed
