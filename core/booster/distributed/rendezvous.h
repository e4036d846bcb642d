// Rendezvous without MPI: rank and world size from environment variables, and a blob of bytes (NCCL's
// unique id) handed from rank 0 to every rank through a shared file or TCP, as torchrun and llm.c
// start NCCL jobs. Independent of NCCL, so it is tested on the CPU (tests/distributed/test_rendezvous).
// Note [Rendezvous without MPI] in distributed/README.md.
#pragma once

#include <chrono>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace booster::distributed {

// This process's place in a job started without MPI.
struct EnvRanks {
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;  // the rank among this machine's processes (picks the GPU)
};

// BOOSTER_RANK / BOOSTER_WORLD_SIZE / BOOSTER_LOCAL_RANK when BOOSTER_WORLD_SIZE is set, else
// torchrun's RANK / WORLD_SIZE / LOCAL_RANK when WORLD_SIZE is set; nullopt when neither is. LOCAL_RANK
// defaults to the rank. ConfigError naming the variable for a missing rank, a value that is not a
// whole number, or a rank outside [0, world size).
std::optional<EnvRanks> ranks_from_environment();

// How rank 0's blob travels.
struct RendezvousSpec {
  enum class Kind { File, Tcp };
  Kind kind = Kind::File;
  std::string file;     // Kind::File: a path every rank sees (a shared file system across machines)
  std::string address;  // Kind::Tcp: rank 0's host name or address
  int port = 0;         // Kind::Tcp: the port rank 0 listens on
  // For messages: the variables it came from, e.g. "BOOSTER_NCCL_ID_FILE".
  std::string source;
  // The job's id, so that two jobs on one file or port do not take each other's blob:
  // TORCHELASTIC_RUN_ID, else SLURM_JOB_ID, else BOOSTER_RUN_ID, else "" (the world size counts too).
  std::string job;
  // The job's secret (Note [Job secret] in distributed/README.md): BOOSTER_JOB_SECRET, else the contents
  // of the file BOOSTER_JOB_SECRET_FILE names (booster run makes one per launch), else "". With one, every
  // TCP hello is a challenge-response over it (an HMAC of the other side's nonce), both ways; the secret
  // itself never travels.
  std::string secret;
};

// BOOSTER_JOB_SECRET, else the trimmed contents of BOOSTER_JOB_SECRET_FILE (a regular file of at most
// 4 KiB), else "". ConfigError for a file that cannot be read, is not a regular file, or is empty.
std::string job_secret_from_environment();

// BOOSTER_NCCL_ID_FILE when set, else MASTER_ADDR and MASTER_PORT (both: ConfigError when one is
// missing, or the port is not from 1 to 65535); nullopt when none is set.
std::optional<RendezvousSpec> rendezvous_from_environment();

// Rank 0's `blob` on every rank: each of the `world_size` ranks calls it once, rank 0 with the blob
// (up to 1 MiB), the others with anything (ignored); each returns rank 0's blob. Rank 0 returns once
// every rank has it, so the file or socket can be reused afterwards. DistributedError naming what it
// waited for when `timeout` passes first; ConfigError for an address that does not resolve, a port in
// use, or a file that cannot be written.
std::vector<uint8_t> share_from_rank0(const RendezvousSpec& spec, int rank, int world_size,
                                      const std::vector<uint8_t>& blob, std::chrono::duration<double> timeout);

}  // namespace booster::distributed
