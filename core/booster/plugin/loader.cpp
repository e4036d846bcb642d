// The plugin loader: search path, Boost.DLL loading, the ABI check, and error conversion at the
// boundary. See loader.h and abi.h.
#include "booster/plugin/loader.h"

#include <dlfcn.h>
#include <elf.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <boost/dll/shared_library.hpp>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <set>
#include <system_error>

#include "booster/plugin/abi.h"

namespace booster::plugin {

namespace fs = std::filesystem;

struct Plugin::Library {
  boost::dll::shared_library library;
};

Plugin::~Plugin() = default;

void* Plugin::symbol(const std::string& alias) const {
  BOOSTER_CHECK(library_->library.has(alias), PluginError, "plugin '", name_, "' (", file_.string(),
                ") does not export '", alias, "'; a ", kind_, " plugin must export it (see booster/plugin/abi.h)");
  // A Boost.DLL alias is an exported pointer variable holding the address of the real symbol.
  return const_cast<void*>(library_->library.get<const void*>(alias));
}

namespace {

bool known_kind(const std::string& kind) {
  return kind == kPrecisionKind || kind == kParallelKind || kind == kModelKind;
}

const char* const kKindChoices = "precision, parallel or model";

std::string prefix_of(const std::string& kind) {
  if (kind == kPrecisionKind) return "libbooster_precision_";
  if (kind == kModelKind) return "libbooster_model_";
  return "libbooster_plugin_";
}

}  // namespace

std::string entry_point(const std::string& kind) {
  BOOSTER_CHECK(known_kind(kind), ValueError, "plugin: unknown kind '", kind, "'; expected ", kKindChoices);
  return kind == kModelKind ? "booster_register_models" : "booster_create_" + kind;
}

namespace {

}  // namespace

std::string file_name(const std::string& kind, const std::string& name) {
  BOOSTER_CHECK(known_kind(kind), ValueError, "plugin: unknown kind '", kind, "'; expected ", kKindChoices);
  return prefix_of(kind) + name + ".so";
}

bool is_path(const std::string& name_or_path) {
  const std::string so = ".so";
  return name_or_path.find('/') != std::string::npos ||
         (name_or_path.size() > so.size() && name_or_path.compare(name_or_path.size() - so.size(), so.size(), so) == 0);
}

fs::path core_library_dir() {
  // Note [Relocatable plugin search]: the directory of the libbooster_core that is running, asked of
  // the dynamic loader, so a build tree or install prefix that was copied or moved finds its own
  // plugins and never the original's.
  Dl_info info{};
  static const int anchor = 0;
  if (dladdr(&anchor, &info) == 0 || info.dli_fname == nullptr) return {};
  std::error_code ec;
  fs::path lib = fs::canonical(info.dli_fname, ec);
  if (ec) lib = fs::absolute(info.dli_fname, ec);
  return lib.parent_path();
}

std::vector<fs::path> search_path() {
  std::vector<fs::path> dirs;
  if (const char* env = std::getenv("BOOSTER_PLUGIN_PATH")) {
    std::string list = env;
    size_t start = 0;
    while (start <= list.size()) {
      const size_t end = std::min(list.find(':', start), list.size());
      if (end > start) dirs.emplace_back(list.substr(start, end - start));  // empty entries are skipped
      start = end + 1;
    }
  }
  const fs::path core_dir = core_library_dir();
  if (!core_dir.empty()) {
    dirs.push_back(core_dir / "booster");  // an install prefix: <prefix>/lib/booster
    dirs.push_back(core_dir);              // the build tree: build/lib
  }
  return dirs;
}

std::string describe_search_path() {
  std::string out;
  for (const fs::path& d : search_path()) out += (out.empty() ? "" : ", ") + d.string();
  return out;
}

std::string describe_search(const std::string& kind, const std::string& name) {
  const char* env = std::getenv("BOOSTER_PLUGIN_PATH");
  const std::string env_text = env ? std::string("BOOSTER_PLUGIN_PATH=") + env : "BOOSTER_PLUGIN_PATH unset";
  return "looked for " + file_name(kind, name) + " in " + describe_search_path() + " (" + env_text +
         ", then beside libbooster_core); set BOOSTER_PLUGIN_PATH to add directories, or give the path to the .so";
}

fs::path find_or_empty(const std::string& kind, const std::string& name) {
  const std::string file = file_name(kind, name);
  for (const fs::path& dir : search_path()) {
    std::error_code ec;
    const fs::path candidate = dir / file;
    if (fs::is_regular_file(candidate, ec)) return candidate;
  }
  return {};
}

fs::path find(const std::string& kind, const std::string& name) {
  fs::path file = find_or_empty(kind, name);
  BOOSTER_CHECK(!file.empty(), PluginError, "plugin: no ", kind, " plugin named '", name, "': ",
                describe_search(kind, name));
  return file;
}

std::vector<Found> list(const std::string& kind) {
  std::map<std::pair<std::string, std::string>, fs::path> found;  // first of each (kind, name) wins
  for (const fs::path& dir : search_path()) {
    std::error_code ec;
    if (!fs::is_directory(dir, ec)) continue;
    for (const auto& entry : fs::directory_iterator(dir, ec)) {
      const std::string file = entry.path().filename().string();
      for (const std::string k : {kPrecisionKind, kParallelKind, kModelKind}) {
        if (!kind.empty() && kind != k) continue;
        const std::string prefix = prefix_of(k);
        if (file.size() > prefix.size() + 3 && file.rfind(prefix, 0) == 0 && file.ends_with(".so")) {
          const std::string name = file.substr(prefix.size(), file.size() - prefix.size() - 3);
          found.emplace(std::make_pair(k, name), entry.path());
        }
      }
    }
  }
  std::vector<Found> out;
  for (const auto& [key, file] : found) out.push_back({key.first, key.second, file});
  return out;
}

// Note [Checking a library before dlopen]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// dlopen() maps a library's segments as its program headers describe them and reads them through the
// mapping. A file cut short (an interrupted copy or install, a full disk) still has headers that claim
// the bytes it lost, and the first touch of a page past its end is SIGBUS inside the dynamic loader:
// the process dies without a word. So before dlopen the file is read as an ELF header would be, and
// refused with a PluginError naming it when it is not a regular file, is shorter than an ELF header,
// lacks the ELF magic, is not 64-bit little-endian, is built for another machine (x86-64 on this
// build's x86-64, the build's own e_machine elsewhere) or is not a shared object, or when the file is
// shorter than what its headers reach: the program header table (e_phoff + e_phnum * e_phentsize),
// the section header table (e_shoff + e_shnum * e_shentsize) and the file bytes of every segment
// (p_offset + p_filesz), all in 64-bit arithmetic checked for overflow. What is checked is the file
// given; a damaged library it depends on is found by the dynamic loader as before, and a file
// changed between the check and dlopen is not (the check is for damage, not for an adversary).
namespace {

#if defined(__x86_64__)
constexpr int kBuildMachine = EM_X86_64;
#elif defined(__aarch64__)
constexpr int kBuildMachine = EM_AARCH64;
#elif defined(__powerpc64__)
constexpr int kBuildMachine = EM_PPC64;
#elif defined(__riscv)
constexpr int kBuildMachine = EM_RISCV;
#else
constexpr int kBuildMachine = -1;  // unknown: the machine is not checked
#endif

std::string machine_name(int machine) {
  switch (machine) {
    case EM_X86_64: return "x86-64";
    case EM_386: return "i386";
    case EM_AARCH64: return "AArch64";
    case EM_ARM: return "ARM";
    case EM_PPC64: return "PowerPC64";
    case EM_RISCV: return "RISC-V";
    case EM_S390: return "s390";
    default: return "machine " + std::to_string(machine);
  }
}

// a + b * c, or UINT64_MAX where it overflows (a table that cannot lie in any file).
uint64_t table_end(uint64_t offset, uint64_t count, uint64_t entry_size) {
  uint64_t bytes = 0, end = 0;
  if (__builtin_mul_overflow(count, entry_size, &bytes) || __builtin_add_overflow(offset, bytes, &end))
    return UINT64_MAX;
  return end;
}

[[noreturn]] void refuse_library(const fs::path& file, const std::string& what) {
  BOOSTER_FAIL(PluginError, "plugin: cannot load ", file.string(), ": ", what, "; rebuild or reinstall it");
}

void check_library_file(const fs::path& file) {
  const int fd = ::open(file.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);  // O_NONBLOCK: a FIFO must not block
  BOOSTER_CHECK(fd >= 0, PluginError, "plugin: cannot open ", file.string(), ": ", std::strerror(errno));
  struct Closer {
    int fd;
    ~Closer() { ::close(fd); }
  } closer{fd};
  struct stat st {};
  BOOSTER_CHECK(::fstat(fd, &st) == 0, PluginError, "plugin: cannot stat ", file.string(), ": ", std::strerror(errno));
  BOOSTER_CHECK(S_ISREG(st.st_mode), PluginError, "plugin: ", file.string(),
                " is not a regular file (a directory, a FIFO or a device); give the path of a plugin's .so");
  const uint64_t size = uint64_t(st.st_size);
  auto read_at = [&](void* out, size_t bytes, uint64_t offset) {
    size_t done = 0;
    while (done < bytes) {
      const ssize_t n = ::pread(fd, static_cast<char*>(out) + done, bytes - done, off_t(offset + done));
      if (n < 0 && errno == EINTR) continue;
      BOOSTER_CHECK(n >= 0, PluginError, "plugin: cannot read ", file.string(), ": ", std::strerror(errno));
      if (n == 0) refuse_library(file, "it ended while being read (truncated while loading?)");
      done += size_t(n);
    }
  };

  if (size < sizeof(Elf64_Ehdr))
    refuse_library(file, "truncated: " + std::to_string(size) + " bytes, shorter than the " +
                             std::to_string(sizeof(Elf64_Ehdr)) + " bytes of an ELF header; not a shared library");
  Elf64_Ehdr header{};
  read_at(&header, sizeof header, 0);
  if (std::memcmp(header.e_ident, ELFMAG, SELFMAG) != 0)
    refuse_library(file, "not an ELF file (no ELF magic at its start); not a shared library");
  if (header.e_ident[EI_CLASS] != ELFCLASS64)
    refuse_library(file, std::string("a ") + (header.e_ident[EI_CLASS] == ELFCLASS32 ? "32-bit" : "malformed") +
                             " ELF file; this booster loads 64-bit libraries only");
  if (header.e_ident[EI_DATA] != ELFDATA2LSB)
    refuse_library(file, "a big-endian ELF file; this booster is little-endian");
  if (kBuildMachine >= 0 && header.e_machine != kBuildMachine)
    refuse_library(file, "built for " + machine_name(header.e_machine) + ", not for " + machine_name(kBuildMachine) +
                             " as this booster is");
  if (header.e_type != ET_DYN)
    refuse_library(file, "an ELF file of type " + std::to_string(header.e_type) +
                             ", not a shared library (ET_DYN); build it with -shared");

  // How far its headers reach. e_shnum 0 with e_shoff set means 0xff00 sections or more, counted in
  // section 0: at least that one entry must be there.
  uint64_t reach = sizeof(Elf64_Ehdr);
  const uint64_t phnum = header.e_phnum, shnum = header.e_shnum == 0 && header.e_shoff != 0 ? 1 : header.e_shnum;
  if (phnum > 0 && header.e_phentsize < sizeof(Elf64_Phdr))
    refuse_library(file, "malformed: program header entries of " + std::to_string(header.e_phentsize) + " bytes");
  const uint64_t ph_end = phnum > 0 ? table_end(header.e_phoff, phnum, header.e_phentsize) : 0;
  const uint64_t sh_end = shnum > 0 ? table_end(header.e_shoff, shnum, header.e_shentsize) : 0;
  reach = std::max({reach, ph_end, sh_end});
  if (ph_end <= size) {
    // Every segment's file bytes, which dlopen maps (a cut library is SIGBUS on first touch otherwise).
    for (uint64_t i = 0; i < phnum; ++i) {
      Elf64_Phdr ph{};
      read_at(&ph, sizeof ph, header.e_phoff + i * header.e_phentsize);
      if (ph.p_type == PT_NULL || ph.p_filesz == 0) continue;  // nothing of the file is mapped for it
      reach = std::max(reach, table_end(ph.p_offset, 1, ph.p_filesz));
    }
  }
  if (reach > size)
    refuse_library(file, "truncated: " + std::to_string(size) + " bytes, its headers reach " +
                             (reach == UINT64_MAX ? std::string("past 2^64") : std::to_string(reach)));
}

// Note [A library that exits while loading]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// dlopen() runs a library's static constructors. One that calls exit() (a plugin that "checks its
// environment" and quits, a library linked with a program's main objects) would end booster there,
// and with exit(0) a CI job would report a run that never trained as a success. exit() cannot be
// stopped, but it runs the handlers registered with atexit()/on_exit() first, last registered first.
// So right before each dlopen the loader registers a handler (on_exit, which also receives the
// status) and marks, in a thread_local, which file this thread is loading; the mark is cleared when
// dlopen returns or throws. A handler that finds its thread still loading prints one line naming the
// library and the status it exited with, and ends the process with _exit(1), booster's status for a
// run-time error (a PluginError). The handlers the library itself registered run before it (they were
// registered later); booster's own, registered earlier, are skipped by _exit, so nothing of the half
// loaded state is torn down. An exit on another thread, or after dlopen returned, is untouched: the
// handler then does nothing. One handler per load is registered (glibc's list grows as needed), so
// that it runs right after the library's own, whatever else registered handlers since the last load.
// Not covered: _exit(), quick_exit() and signals, which run no handlers (a signal's status is not 0).
thread_local const char* loading_library = nullptr;

void exit_while_loading(int status, void*) {
  if (loading_library == nullptr) return;
  std::fprintf(stderr,
               "booster: error: plugin: %s called exit(%d) while it was being loaded (a static constructor of it, "
               "or of a library it needs, ended the process); fix or rebuild it, or leave it out of the run\n",
               loading_library, status);
  std::fflush(stderr);
  ::_exit(1);
}

// Marks this thread as loading `file` for as long as it lives (Note [A library that exits while loading]).
class ExitGuard {
 public:
  explicit ExitGuard(const fs::path& file) : path_(file.string()), previous_(loading_library) {
#if defined(__GLIBC__)
    ::on_exit(exit_while_loading, nullptr);
#else
    std::atexit([] { exit_while_loading(0, nullptr); });
#endif
    loading_library = path_.c_str();
  }
  ~ExitGuard() { loading_library = previous_; }
  ExitGuard(const ExitGuard&) = delete;
  ExitGuard& operator=(const ExitGuard&) = delete;

 private:
  std::string path_;
  const char* previous_;
};

}  // namespace

std::shared_ptr<Plugin> load(const std::string& kind, const std::string& name_or_path) {
  BOOSTER_CHECK(known_kind(kind), ValueError, "plugin: unknown kind '", kind, "'; expected ", kKindChoices);
  const fs::path file = is_path(name_or_path) ? fs::path(name_or_path) : find(kind, name_or_path);
  std::error_code exists_ec;
  BOOSTER_CHECK(fs::exists(file, exists_ec), PluginError, "plugin: ", file.string(), " does not exist (a name with '/' ",
                "or ending in .so is a path, loaded as is; a ", kind, " plugin's name is searched for as ",
                file_name(kind, "<name>"), " in ", describe_search_path(),
                ", the directories of BOOSTER_PLUGIN_PATH first)");

  // dlopen() of a FIFO blocks until something writes to it, and of a device reads it: only regular
  // files (or symlinks to them) are opened.
  BOOSTER_CHECK(fs::is_regular_file(file, exists_ec), PluginError, "plugin: ", file.string(),
                " is not a regular file (a directory, a FIFO or a device); give the path of a plugin's .so");
  // A truncated or foreign file is refused here, not met as SIGBUS inside dlopen (Note [Checking a
  // library before dlopen]).
  check_library_file(file);

  std::shared_ptr<Plugin> plugin(new Plugin());
  plugin->library_ = std::make_unique<Plugin::Library>();
  plugin->file_ = file;
  boost::dll::fs::error_code ec;
  {
    const ExitGuard guard(file);  // Note [A library that exits while loading]
    // Local binding: two plugins may define the same internal names without clashing.
    plugin->library_->library.load(file, ec, boost::dll::load_mode::rtld_local | boost::dll::load_mode::rtld_now);
  }
  BOOSTER_CHECK(!ec, PluginError, "plugin: cannot load ", file.string(), ": ", ec.message(),
                " (is it a shared library built for this machine, with its dependencies on the library path?)");

  boost::dll::shared_library& lib = plugin->library_->library;
  BOOSTER_CHECK(lib.has("booster_plugin_abi_version"), PluginError, file.string(),
                " is not a booster plugin: it exports no booster_plugin_abi_version (a plugin is built with one of "
                "the BOOSTER_EXPORT_*_PLUGIN macros of booster/plugin/abi.h, a model library with "
                "BOOSTER_MODEL_LIBRARY of booster/nn/model_registry.h)");
  // The version is read before anything else in the library is called (Note [Plugin ABI]).
  const int version = lib.get_alias<int()>("booster_plugin_abi_version")();
  BOOSTER_CHECK(version == BOOSTER_PLUGIN_ABI_VERSION, PluginError, "plugin: ", file.string(),
                " was built for plugin ABI version ", version, " but this booster has ABI version ",
                BOOSTER_PLUGIN_ABI_VERSION, "; rebuild the plugin against this booster");
  plugin->abi_version_ = version;
  BOOSTER_CHECK(lib.has("booster_plugin_kind") && lib.has("booster_plugin_name"), PluginError, file.string(),
                " is not a complete booster plugin: it must export booster_plugin_kind and booster_plugin_name");
  plugin->kind_ = lib.get_alias<const char*()>("booster_plugin_kind")();
  plugin->name_ = lib.get_alias<const char*()>("booster_plugin_name")();
  auto noun = [](const std::string& k) { return k == kModelKind ? std::string("model library") : k + " plugin"; };
  BOOSTER_CHECK(plugin->kind_ == kind, PluginError, "plugin: ", file.string(), " is a ", noun(plugin->kind_),
                " ('", plugin->name_, "'), not a ", noun(kind));
  BOOSTER_CHECK(lib.has(entry_point(kind)), PluginError, "plugin: ", file.string(), " ('", plugin->name_,
                "') exports no ", entry_point(kind), " entry point");
  return plugin;
}

namespace {
std::atomic<int64_t> precision_factory_calls{0};
std::atomic<int64_t> parallel_factory_calls{0};
std::atomic<int64_t> model_factory_calls{0};
std::atomic<int64_t>& factory_counter(const std::string& kind) {
  BOOSTER_CHECK(known_kind(kind), ValueError, "plugin: unknown kind '", kind, "'; expected ", kKindChoices);
  if (kind == kModelKind) return model_factory_calls;
  return kind == kPrecisionKind ? precision_factory_calls : parallel_factory_calls;
}
}  // namespace

int64_t factory_calls(const std::string& kind) { return factory_counter(kind).load(); }
void count_factory_call(const std::string& kind) { ++factory_counter(kind); }

void rethrow_as_host_error(const Plugin& plugin, const std::string& what_call) {
  // A new exception built here, in the host, so nothing thrown on carries pointers into the plugin.
  try {
    throw;
  }
#define BOOSTER_RETHROW_AS(Type) \
  catch (const Type& e) {        \
    throw Type(e.what());        \
  }
  BOOSTER_RETHROW_AS(ShapeError)
  BOOSTER_RETHROW_AS(DTypeError)
  BOOSTER_RETHROW_AS(IndexError)
  BOOSTER_RETHROW_AS(ValueError)
  BOOSTER_RETHROW_AS(DeviceError)
  BOOSTER_RETHROW_AS(AutogradError)
  BOOSTER_RETHROW_AS(StateError)
  BOOSTER_RETHROW_AS(ConfigError)
  BOOSTER_RETHROW_AS(IncompatibleError)
  BOOSTER_RETHROW_AS(PluginError)
  BOOSTER_RETHROW_AS(CheckpointError)
  BOOSTER_RETHROW_AS(DataError)
  BOOSTER_RETHROW_AS(DistributedError)
  BOOSTER_RETHROW_AS(NotImplementedError)
  BOOSTER_RETHROW_AS(TrainingError)
  BOOSTER_RETHROW_AS(OutOfMemoryError)
  BOOSTER_RETHROW_AS(Error)
#undef BOOSTER_RETHROW_AS
  catch (const std::exception& e) {
    BOOSTER_FAIL(PluginError, plugin.kind(), " plugin '", plugin.name(), "' (", plugin.file().string(), ") threw from ",
                 what_call, ": ", e.what());
  } catch (...) {
    BOOSTER_FAIL(PluginError, plugin.kind(), " plugin '", plugin.name(), "' (", plugin.file().string(),
                 ") threw a non-standard exception from ", what_call);
  }
}

}  // namespace booster::plugin
