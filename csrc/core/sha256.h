// SHA-256 (FIPS 180-4) and HMAC-SHA256 (RFC 2104), for the handshakes of the
// TCP transport (transport/tcp/tcp_auth.h); no OpenSSL dependency. Also the
// constant-time comparison of MACs and ids, and random bytes from the kernel
// (getrandom: the nonces, the ids, the keys' material).
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>

namespace pyc {

using Digest = std::array<uint8_t, 32>;

class Sha256 {
 public:
  Sha256();
  void update(const void* data, size_t n);
  Digest finish();  // the object is spent afterwards

 private:
  void block(const uint8_t* p);
  uint32_t h_[8];
  uint8_t buf_[64];
  size_t used_ = 0;
  uint64_t total_ = 0;  // bytes hashed
};

class HmacSha256 {
 public:
  HmacSha256(const void* key, size_t key_bytes);
  void update(const void* data, size_t n) { inner_.update(data, n); }
  Digest finish();

 private:
  Sha256 inner_, outer_;
};

Digest sha256(const void* data, size_t n);
Digest hmac_sha256(const void* key, size_t key_bytes, const void* data, size_t n);

// Whether a[0, n) == b[0, n), in a time that depends on n only.
bool equal_ct(const void* a, const void* b, size_t n);

// Fills out[0, n) from getrandom(2) (blocking until the kernel's pool is
// initialized, as it is long before any job runs).
void random_bytes(void* out, size_t n);

// Zeroes memory that held a key, in a way the compiler does not drop.
void wipe(void* p, size_t n);

}  // namespace pyc
