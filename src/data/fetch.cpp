#include "data/fetch.h"

#include <htslib/bgzf.h>
#include <stdlib.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <memory>
#include <set>
#include <sstream>

#include "core/error.h"
#include "core/process.h"
#include "core/sha256.h"

namespace spindle {
namespace {

namespace fs = std::filesystem;

std::string strip_dot_slash(const std::string& path) {
  return path.rfind("./", 0) == 0 ? path.substr(2) : path;
}

std::string megabytes(uintmax_t bytes) {
  char text[32];
  std::snprintf(text, sizeof text, "%.1f MB", static_cast<double>(bytes) / 1e6);
  return text;
}

std::string trimmed(const std::string& text) {
  const size_t end = text.find_last_not_of(" \n\r\t");
  return end == std::string::npos ? std::string() : text.substr(0, end + 1);
}

// A scratch directory inside the data directory (same file system, so renames are atomic),
// removed with everything in it.
struct ScratchDir {
  std::string path;
  explicit ScratchDir(const std::string& parent) {
    std::string pattern = (fs::path(parent) / ".spindle-get-XXXXXX").string();
    check(mkdtemp(pattern.data()) != nullptr, "cannot create a temporary directory in ", parent);
    path = pattern;
  }
  ~ScratchDir() {
    std::error_code ignored;
    fs::remove_all(path, ignored);
  }
};

void require_program(const std::string& program, const std::string& why) {
  check(find_program(program).has_value(), program, " not found on PATH: ", why);
}

std::vector<std::string> list_members(const std::string& tar, const std::string& deb) {
  const ProcessResult listing = run_process({"tar", "-tf", tar});
  check(listing.exit_code == 0, "cannot list the files of ", deb, " (tar -tf exit ", listing.exit_code,
        "): ", trimmed(listing.errors));
  std::vector<std::string> members;
  std::istringstream lines(listing.output);
  for (std::string line; std::getline(lines, line);) {
    if (!line.empty()) members.push_back(line);
  }
  return members;
}

// Up to 10 members that look like `wanted`: the same file name, else the same folder, else the
// same extension.
std::vector<std::string> similar_members(const std::vector<std::string>& members, const std::string& wanted) {
  const fs::path path(strip_dot_slash(wanted));
  const std::vector<std::function<bool(const fs::path&)>> tests = {
      [&](const fs::path& p) { return p.filename() == path.filename(); },
      [&](const fs::path& p) { return p.parent_path() == path.parent_path(); },
      [&](const fs::path& p) { return !p.extension().empty() && p.extension() == path.extension(); },
  };
  for (const auto& test : tests) {
    std::vector<std::string> found;
    for (const auto& m : members) {
      if (found.size() < 10 && !m.empty() && m.back() != '/' && test(fs::path(strip_dot_slash(m)))) {
        found.push_back(m);
      }
    }
    if (!found.empty()) return found;
  }
  return {};
}

const std::string* find_member(const std::vector<std::string>& members, const std::string& wanted) {
  for (const auto& m : members) {
    if (strip_dot_slash(m) == strip_dot_slash(wanted)) return &m;
  }
  return nullptr;
}

void extract_member(const std::string& tar, const std::string& member, const std::string& to,
                    const std::string& deb) {
  const ProcessResult result = run_process({"tar", "-xOf", tar, member}, {}, to);
  check(result.exit_code == 0, "cannot extract ", member, " from ", deb, " (tar exit ", result.exit_code,
        "): ", trimmed(result.errors));
}

void gunzip(const std::string& from, const std::string& to) {
  BGZF* in = bgzf_open(from.c_str(), "r");
  check(in != nullptr, "cannot open ", from);
  std::unique_ptr<BGZF, int (*)(BGZF*)> closer(in, bgzf_close);
  std::ofstream out(to, std::ios::binary | std::ios::trunc);
  std::vector<char> buffer(1 << 16);
  for (;;) {
    const ssize_t n = bgzf_read(in, buffer.data(), buffer.size());
    check(n >= 0, "cannot decompress ", from);
    if (n == 0) break;
    out.write(buffer.data(), n);
  }
  out.close();
  check(!out.fail(), "failed writing ", to);
}

}  // namespace

const std::vector<DataFile>& reference_data() {
  static const std::vector<DataFile> files = {
      {"chr22",
       "small default: chr22:20,000,001-21,000,000 (1 Mbp, GRCh37)",
       "hisat2",
       "./usr/share/doc/hisat2/examples/reference/22_20-21M.fa",
       "22_20-21M.fa",
       "5f20f32cf4233e45f91ad3ca2e7928a8b6594040522fe4275b876856c1d9944d",
       {}},
      {"chrX",
       "training: first 70 Mbp of chrX (GRCh37)",
       "smalt-examples",
       "./usr/share/doc/smalt/test/data/hs37chrXtrunc.fa.gz",
       "hs37chrXtrunc.fa.gz",
       "01fe793d0b77f91fa9d2edb8b269d9bc480cf71df469dce4be6e45bec25c749a",
       {}},
      {"chr20",
       "held-out evaluation: all of chr20 (63 Mbp, GRCh37, bgzip)",
       "vt-examples",
       "./usr/share/doc/vt/examples/ref/20.fa.gz",
       "20.fa.gz",
       "83c80b3fb23822ff0a66f26306e46f5db3c83d48fcff68bcddc353a3d8ef581b",
       {".fai", ".gzi"}},
  };
  return files;
}

std::string apt_download(const std::string& package, const std::string& dir) {
  require_program("apt-get",
                  "`spindle data get` downloads Debian packages with `apt-get download`; on "
                  "another system fetch the package's .deb by hand");
  const ProcessResult result = run_process({"apt-get", "download", package}, dir);
  if (result.exit_code != 0) {
    std::string hint;
    if (result.errors.find("Unable to locate package") != std::string::npos ||
        result.errors.find("Can't select") != std::string::npos) {
      hint = "\n(the package lists may be missing or stale: run `apt-get update` as root first)";
    }
    fail("`apt-get download ", package, "` failed (exit ", result.exit_code, "):\n", trimmed(result.errors),
         hint);
  }
  for (const auto& entry : fs::directory_iterator(dir)) {
    const std::string name = entry.path().filename().string();
    if (name.rfind(package + "_", 0) == 0 && entry.path().extension() == ".deb") return entry.path().string();
  }
  fail("`apt-get download ", package, "` succeeded but no ", package, "_*.deb appeared in ", dir);
}

std::string fetch_data_file(const DataFile& file, const std::string& dir, const PackageDownloader& download,
                            std::ostream& out) {
  const std::string target = (fs::path(dir) / file.file_name).string();
  const std::string tag = file.key + ": ";
  if (fs::exists(target)) {
    const std::string got = sha256_file(target);
    if (got == file.sha256) {
      out << tag << target << " already present, SHA-256 ok; not downloaded again\n";
      return target;
    }
    out << tag << target << " has SHA-256 " << got << ", expected " << file.sha256 << "; fetching it again\n";
  }
  fs::create_directories(dir);
  require_program("dpkg-deb", "needed to open the Debian package " + file.package);
  require_program("tar", "needed to open the Debian package " + file.package);
  ScratchDir scratch(dir);

  out << tag << "downloading Debian package " << file.package << " (" << file.role << ")\n" << std::flush;
  const std::string deb = download(file.package, scratch.path);
  out << tag << "got " << fs::path(deb).filename().string() << " (" << megabytes(fs::file_size(deb)) << ")\n";

  const std::string tar = (fs::path(scratch.path) / "data.tar").string();
  const ProcessResult unpacked = run_process({"dpkg-deb", "--fsys-tarfile", deb}, {}, tar);
  check(unpacked.exit_code == 0, "`dpkg-deb --fsys-tarfile ", deb, "` failed (exit ", unpacked.exit_code,
        "): ", trimmed(unpacked.errors));
  const std::vector<std::string> members = list_members(tar, deb);
  const std::string* member = find_member(members, file.member);
  if (member == nullptr) {
    const auto similar = similar_members(members, file.member);
    std::ostringstream text;
    for (const auto& s : similar) text << "\n  " << s;
    fail("package ", fs::path(deb).filename().string(), " has no file ", file.member,
         similar.empty() ? "; nothing similar among its " + std::to_string(members.size()) + " entries"
                         : "; similar paths in it:" + text.str(),
         "\n(the package version may have changed; see shared/data/README.md)");
  }

  // Everything is extracted and checked beside the target before anything is renamed over it.
  const std::string temp = (fs::path(scratch.path) / file.file_name).string();
  extract_member(tar, *member, temp, deb);
  const std::string got = sha256_file(temp);
  check(got == file.sha256, "SHA-256 mismatch for ", *member, " from ", fs::path(deb).filename().string(),
        ": expected ", file.sha256, ", got ", got, "; the file was not kept");
  std::vector<std::string> sidecars;
  for (const auto& suffix : file.sidecars) {
    const std::string sidecar_target = target + suffix;
    if (const std::string* index = find_member(members, file.member + suffix)) {
      extract_member(tar, *index, temp + suffix, deb);
    } else if (const std::string* packed = find_member(members, file.member + suffix + ".gz")) {
      // Debian gzips larger files under /usr/share/doc (vt-examples ships 20.fa.gz.gzi.gz).
      extract_member(tar, *packed, temp + suffix + ".gz", deb);
      gunzip(temp + suffix + ".gz", temp + suffix);
    } else {
      // An index of some other copy would not fit this file; htslib rebuilds it when needed.
      std::error_code ignored;
      if (fs::remove(sidecar_target, ignored)) out << tag << "removed stale " << sidecar_target << "\n";
      continue;
    }
    sidecars.push_back(suffix);
  }
  for (const auto& suffix : sidecars) fs::rename(temp + suffix, target + suffix);
  fs::rename(temp, target);
  out << tag << "wrote " << target << " (" << fs::file_size(target) << " bytes, SHA-256 ok)\n";
  for (const auto& suffix : sidecars) {
    out << tag << "wrote " << target + suffix << " (" << fs::file_size(target + suffix)
        << " bytes, index from the same package)\n";
  }
  return target;
}

std::vector<std::string> fetch_data(const FetchOptions& options, std::ostream& out) {
  std::vector<const DataFile*> chosen;
  std::set<std::string> wanted(options.only.begin(), options.only.end());
  for (const auto& key : wanted) {
    const auto& all = reference_data();
    const bool known =
        std::any_of(all.begin(), all.end(), [&](const DataFile& file) { return file.key == key; });
    check(known, "unknown data set '", key, "': expected chr22, chrX or chr20");
  }
  for (const auto& file : reference_data()) {
    if (wanted.empty() || wanted.count(file.key)) chosen.push_back(&file);
  }
  std::vector<std::string> paths;
  for (const DataFile* file : chosen)
    paths.push_back(fetch_data_file(*file, options.dir, options.download, out));
  return paths;
}

}  // namespace spindle
