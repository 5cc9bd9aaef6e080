#include "core/process.h"

#include <fcntl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "core/error.h"

namespace spindle {
namespace {

namespace fs = std::filesystem;

std::string read_all(const std::string& path) {
  std::ifstream file(path, std::ios::binary);
  std::ostringstream text;
  text << file.rdbuf();
  return text.str();
}

// A temporary file that removes itself.
struct TempFile {
  std::string path;
  TempFile() {
    std::string pattern = (fs::temp_directory_path() / "spindle-process-XXXXXX").string();
    const int fd = mkstemp(pattern.data());
    check(fd >= 0, "cannot create a temporary file in ", fs::temp_directory_path().string(), ": ",
          std::strerror(errno));
    ::close(fd);
    path = pattern;
  }
  ~TempFile() {
    std::error_code ignored;
    fs::remove(path, ignored);
  }
};

}  // namespace

std::optional<std::string> find_program(const std::string& program) {
  if (program.find('/') != std::string::npos) {
    if (::access(program.c_str(), X_OK) == 0) return program;
    return std::nullopt;
  }
  const char* path = std::getenv("PATH");
  std::stringstream dirs(path ? path : "/usr/bin:/bin");
  std::string dir;
  while (std::getline(dirs, dir, ':')) {
    const std::string candidate = (dir.empty() ? std::string(".") : dir) + "/" + program;
    if (::access(candidate.c_str(), X_OK) == 0 && fs::is_regular_file(candidate)) return candidate;
  }
  return std::nullopt;
}

ProcessResult run_process(const std::vector<std::string>& argv, const std::string& cwd,
                          const std::string& stdout_path) {
  check(!argv.empty(), "run_process: no program given");
  const auto program = find_program(argv[0]);
  check(program.has_value(), "program '", argv[0], "' not found on PATH");

  TempFile out_capture, err_capture;
  const std::string out_path = stdout_path.empty() ? out_capture.path : stdout_path;
  std::vector<char*> args;
  for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);

  check(cwd.empty() || fs::is_directory(cwd), "cannot run ", argv[0], " in '", cwd, "': not a directory");
  // Opened here, so a failure is reported properly; the child only rewires them.
  const int in = ::open("/dev/null", O_RDONLY | O_CLOEXEC);
  const int out = ::open(out_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  const int err = ::open(err_capture.path.c_str(), O_WRONLY | O_TRUNC | O_CLOEXEC);
  const std::string open_error = std::strerror(errno);
  auto close_all = [&] {
    for (int fd : {in, out, err}) {
      if (fd >= 0) ::close(fd);
    }
  };
  if (in < 0 || out < 0 || err < 0) {
    close_all();
    fail("cannot run ", argv[0], ": cannot open ", out < 0 ? out_path : std::string("its standard streams"),
         ": ", open_error);
  }
  const pid_t pid = fork();
  if (pid < 0) {
    close_all();
    fail("cannot start ", argv[0], ": fork failed: ", std::strerror(errno));
  }
  if (pid == 0) {
    // Child: only async-signal-safe calls until exec.
    if (!cwd.empty() && chdir(cwd.c_str()) != 0) _exit(127);
    dup2(in, 0);
    dup2(out, 1);
    dup2(err, 2);
    execv(program->c_str(), args.data());
    _exit(127);
  }
  close_all();
  int status = 0;
  while (waitpid(pid, &status, 0) < 0) {
    check(errno == EINTR, "waiting for ", argv[0], " failed: ", std::strerror(errno));
  }
  ProcessResult result;
  result.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  if (stdout_path.empty()) result.output = read_all(out_capture.path);
  result.errors = read_all(err_capture.path);
  return result;
}

}  // namespace spindle
