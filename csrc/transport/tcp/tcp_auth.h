// The handshake that opens every TCP connection between two ranks: a
// challenge-response over HMAC-SHA256 (core/sha256.h) in which each side
// proves that it holds the communicator's key, which never crosses the wire.
//
//   connecting side                            accepting side
//   Hello{kind, comm id, from, to, stripe,  ->
//         world size, nonce_c}
//                                           <- Challenge{nonce_s, mac_s}  (or a refusal)
//   Proof{mac_c}                            ->
//                                           <- Ack{status}
//
// mac_x = HMAC(key, label_x || the Hello's bytes || nonce_s || the accepting
// side's listening address), label_x telling the two sides' MACs apart. So a
// MAC binds both nonces (no replay), both ranks, the kind and the stripe, the
// communicator (its id, and its key, derived from the job's secret and that
// id), and the address the connecting side dialled: a relay (an address
// replaced in the bootstrap store) fails, as the accepting side signs its own
// address. The connecting side checks mac_s before it sends anything else;
// the accepting side adopts a connection only once mac_c checked, and only
// the first for its (from, to, kind, stripe). MACs are compared in constant
// time.
#pragma once

#include <cstdint>
#include <string>

#include "core/sha256.h"
#include "transport/tcp/tcp_socket.h"

namespace pyc {

class WaitMonitor;

constexpr uint64_t kNetMagic = 0x3170636f6c6c7970ull;  // "pycollp1" little-endian
constexpr uint32_t kNetVersion = 2;
constexpr size_t kNonceBytes = 32;
enum class ConnKind : uint32_t { kControl = 1, kData = 2 };

// The key of one communicator's handshakes.
struct NetKey {
  uint8_t bytes[32] = {};
};
// HMAC(secret, label || comm_id): the job's secret (PYCOLL_AUTH_KEY, or the
// material the bootstrap store held) for a communicator made at init, the
// parent's key for one made by split.
NetKey derive_key(const void* secret, size_t secret_bytes, const uint8_t comm_id[16]);

// Wire formats (native byte order: hosts of one job share an architecture,
// which the magic's byte order checks).
struct Hello {  // the first bytes of every connection, from the side that connected
  uint64_t magic;
  uint32_t version;
  uint32_t kind;  // ConnKind
  uint8_t comm_id[16];
  int32_t from;    // the connecting rank
  int32_t to;      // the rank it means to reach
  int32_t stripe;  // data: which of the PYCOLL_SOCKET_NSOCKS sockets
  int32_t world_size;
  uint8_t nonce[kNonceBytes];
};
struct Challenge {  // the answer to a Hello: status 0 and a MAC, or a refusal
  uint64_t magic;
  int32_t rank;
  int32_t status;  // a Refusal
  uint8_t nonce[kNonceBytes];
  uint8_t mac[32];
};
struct Proof {
  uint8_t mac[32];
};
struct HelloAck {  // the last word: status 0 when the connection was adopted
  uint64_t magic;
  int32_t rank;
  int32_t status;
};

// Why a connection was refused (Challenge/HelloAck status).
enum class Refusal : int32_t {
  kNone = 0,
  kVersion,      // another protocol version
  kOtherComm,    // another communicator's id
  kNotForMe,     // meant for another rank or world size
  kNotExpected,  // no such connection is expected from that rank
  kAuth,         // its proof did not verify
  kDuplicate,    // that (from, kind, stripe) is connected already
};
std::string refusal_text(int32_t status);

// The MAC of one side (server: the accepting one) over a handshake.
Digest handshake_mac(const NetKey& key, bool server, const Hello& hello,
                     const uint8_t nonce_s[kNonceBytes], const SockAddr& listen_addr);

// What went wrong when this rank connected to a peer.
struct DialFailure {
  int err = 0;              // errno of the socket (-1: the peer closed it), or 0
  int32_t status = 0;       // the peer's Refusal, or 0
  bool bad_peer = false;    // its answer was not the protocol, or its MAC did not verify
  bool after_auth = false;  // it closed after this rank's proof went
  int tries = 0;
  std::string text() const;  // "it refused ...", for the caller's message
  bool auth() const { return bad_peer || status == static_cast<int32_t>(Refusal::kAuth); }
};

// Connects to `addr` (a peer's listening address) and runs the handshake for
// `hello` (nonce filled in here) with `key`; returns the socket, ready for
// frames, or -1 with *why filled in. A connection the peer drops before it
// answers (its table of pending handshakes full under a flood, say) is tried
// again, a few times within about a second; a refusal is not. Waits through
// `mon` (its checks raise at its deadline).
int dial(const SockAddr& addr, Hello hello, const NetKey& key, const NetConfig& cfg,
         WaitMonitor& mon, DialFailure* why);

}  // namespace pyc
