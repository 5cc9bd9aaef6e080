// `spindle data get`: real DNA from Debian's archive (see shared/data/README.md). Each file is
// taken from a Debian package (apt-get download, no root needed), found by its path inside the
// package, checked against its published SHA-256 and written atomically into a data directory.
#pragma once

#include <functional>
#include <ostream>
#include <string>
#include <vector>

namespace spindle {

struct DataFile {
  std::string key;        // what --only names: "chr22", "chrX", "chr20"
  std::string role;       // one line for people
  std::string package;    // Debian package that ships it
  std::string member;     // path inside the package
  std::string file_name;  // name in the data directory
  std::string sha256;     // published checksum of the file
  // Suffixes of index files taken from the package too when it has them (".fai", ".gzi").
  std::vector<std::string> sidecars;
};

// The three sequences of shared/data/README.md.
const std::vector<DataFile>& reference_data();

// Puts `package`'s .deb into `dir` and returns its path.
using PackageDownloader = std::function<std::string(const std::string& package, const std::string& dir)>;

// `apt-get download PACKAGE` run in `dir`; failures carry apt-get's stderr.
std::string apt_download(const std::string& package, const std::string& dir);

// Makes sure `file` is in `dir` with the right checksum (downloading only when it is not) and
// reports each step on `out`. Returns the file's path.
std::string fetch_data_file(const DataFile& file, const std::string& dir, const PackageDownloader& download,
                            std::ostream& out);

struct FetchOptions {
  std::string dir = "data";
  std::vector<std::string> only;  // keys; every file when empty
  PackageDownloader download = apt_download;
};

std::vector<std::string> fetch_data(const FetchOptions& options, std::ostream& out);

}  // namespace spindle
