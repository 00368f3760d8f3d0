// WireWriter / WireReader: the little-endian byte layout shared by side-channel
// frames, metadata and the ipc handshake.
//
// The reader never trusts its input: every read is bounds-checked, a failed
// read leaves the reader in a failed state (reads after it return zero
// values), and counts are checked against the bytes left before anything is
// allocated, so a hostile length cannot make it allocate gigabytes.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace siesta::transfer {

class WireWriter {
 public:
  void u8(uint8_t v) { out_.push_back(static_cast<char>(v)); }
  void u16(uint16_t v) { put_le(v, 2); }
  void u32(uint32_t v) { put_le(v, 4); }
  void u64(uint64_t v) { put_le(v, 8); }
  // A u32 length, then the bytes.
  void bytes(std::string_view v);
  void raw(std::string_view v) { out_.append(v); }

  const std::string& data() const { return out_; }
  std::string take() { return std::move(out_); }

 private:
  void put_le(uint64_t v, int n);
  std::string out_;
};

class WireReader {
 public:
  explicit WireReader(std::string_view in) : in_(in) {}

  uint8_t u8();
  uint16_t u16();
  uint32_t u32();
  uint64_t u64();
  // A u32 length, then that many bytes; fails when the length exceeds max or the input.
  std::string bytes(size_t max = SIZE_MAX);
  // Exactly n bytes, no length before them.
  std::string raw(size_t n);
  // A u32 element count, checked so that count * min_element_bytes fits in what is left.
  uint32_t count(size_t min_element_bytes, uint32_t max = UINT32_MAX);

  bool ok() const { return ok_; }
  bool at_end() const { return pos_ == in_.size(); }
  size_t remaining() const { return in_.size() - pos_; }
  // True when every read succeeded and nothing is left over.
  bool done() const { return ok_ && at_end(); }

 private:
  uint64_t get_le(int n);
  std::string_view in_;
  size_t pos_ = 0;
  bool ok_ = true;
};

}  // namespace siesta::transfer
