#include "data/mapped_file.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "core/error.h"

namespace spindle {

MappedFile::MappedFile(const std::string& path, const std::string& what) : path_(path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    if (errno == ENOENT) fail(what, " not found: ", path);
    fail("cannot open ", what, " ", path, ": ", std::strerror(errno));
  }
  struct stat info {};
  if (fstat(fd, &info) != 0 || !S_ISREG(info.st_mode)) {
    ::close(fd);
    fail(what, " ", path, " is not a regular file");
  }
  size_ = static_cast<size_t>(info.st_size);
  if (size_ == 0) {  // mmap rejects empty files; an empty mapping is still a valid answer
    ::close(fd);
    return;
  }
  void* data = mmap(nullptr, size_, PROT_READ, MAP_PRIVATE, fd, 0);
  const int error = errno;
  ::close(fd);  // the mapping stays valid without the descriptor
  if (data == MAP_FAILED)
    fail("cannot mmap ", what, " ", path, " (", size_, " bytes): ", std::strerror(error));
  data_ = static_cast<const unsigned char*>(data);
}

MappedFile::~MappedFile() {
  if (data_ != nullptr) munmap(const_cast<unsigned char*>(data_), size_);
}

}  // namespace spindle
