#include "transfer/wire.h"

namespace siesta::transfer {

void WireWriter::put_le(uint64_t v, int n) {
  for (int i = 0; i < n; ++i) out_.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}

void WireWriter::bytes(std::string_view v) {
  u32(static_cast<uint32_t>(v.size()));
  out_.append(v);
}

uint64_t WireReader::get_le(int n) {
  if (!ok_ || remaining() < static_cast<size_t>(n)) {
    ok_ = false;
    return 0;
  }
  uint64_t v = 0;
  for (int i = 0; i < n; ++i) v |= static_cast<uint64_t>(static_cast<uint8_t>(in_[pos_ + i])) << (8 * i);
  pos_ += static_cast<size_t>(n);
  return v;
}

uint8_t WireReader::u8() { return static_cast<uint8_t>(get_le(1)); }
uint16_t WireReader::u16() { return static_cast<uint16_t>(get_le(2)); }
uint32_t WireReader::u32() { return static_cast<uint32_t>(get_le(4)); }
uint64_t WireReader::u64() { return get_le(8); }

std::string WireReader::bytes(size_t max) {
  uint32_t n = u32();
  if (!ok_ || n > remaining() || n > max) {
    ok_ = false;
    return {};
  }
  std::string v(in_.substr(pos_, n));
  pos_ += n;
  return v;
}

std::string WireReader::raw(size_t n) {
  if (!ok_ || n > remaining()) {
    ok_ = false;
    return {};
  }
  std::string v(in_.substr(pos_, n));
  pos_ += n;
  return v;
}

uint32_t WireReader::count(size_t min_element_bytes, uint32_t max) {
  uint32_t n = u32();
  if (!ok_ || n > max || (min_element_bytes > 0 && n > remaining() / min_element_bytes)) {
    ok_ = false;
    return 0;
  }
  return n;
}

}  // namespace siesta::transfer
