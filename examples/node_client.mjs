// A minips client for Node.js 20, written from docs/protocol.md alone: no npm packages, only
// Node's built-ins, with its own small msgpack encoder/decoder and LZ4 block decoder.
//
//   MINIPS_TOKEN=secret node examples/node_client.mjs HOST PORT [--out weights.f32]
//       evaluator: handshake, one PULL of the global weights, frame checks, the raw
//       little-endian float32 weights to --out, one JSON line on stdout, LEAVE.
//   MINIPS_TOKEN=secret node examples/node_client.mjs HOST PORT --worker [--k 50]
//       worker (section 9): STATS on the global server until ASSIGN, then on the group
//       server PULL, PUSH of a made-up sparse-v1 gradient of k coordinates, ACK, PULL; one
//       JSON line saying which weights moved; LEAVE on both. --out writes the weights after
//       the step.
//
// Exit status: 0 done, 1 refused or ERROR from the server, 2 the server broke the protocol
// (or bad command-line arguments), 3 the connection failed.

import net from 'node:net';
import crypto from 'node:crypto';
import fs from 'node:fs';
import process from 'node:process';

// ---------------------------------------------------------------------------------------------
// Failures, one class per exit status, so main() maps them without guessing.

class Refused extends Error { exitCode = 1; }         // REFUSE, ERROR, or a failed server proof
class ProtocolBroken extends Error {                  // a frame or message we must not accept
  exitCode = 2;
  constructor(message, code = 'protocol_error') { super(message); this.code = code; } // ERROR's code
}
class ConnectionFailed extends Error { exitCode = 3; } // TCP trouble, silence, early close

// ---------------------------------------------------------------------------------------------
// msgpack, the subset of section 1.3: nil, bool, int, float, str, bin, array, map.

/** Marks a number that must go out as a msgpack float 64, even when it is integral. */
class Float64 { constructor(value) { this.value = value; } }

// Section 6's decoding limits, checked while decoding the map.
const MAX_STR = 64 * 1024, MAX_BIN = 64 * 1024, MAX_ARRAY = 4096, MAX_MAP = 1024, MAX_DEPTH = 8;

function packInt(out, n) {
  // Smallest form, as msgpack encoders usually do; BigInt only for values past 2^53.
  if (typeof n === 'bigint') {
    const b = Buffer.alloc(9);
    if (n < 0n) { b[0] = 0xd3; b.writeBigInt64BE(n, 1); } else { b[0] = 0xcf; b.writeBigUInt64BE(n, 1); }
    out.push(b);
  } else if (n >= 0 && n <= 0x7f) out.push(Buffer.from([n]));
  else if (n < 0 && n >= -32) out.push(Buffer.from([n & 0xff]));
  else if (n >= 0 && n <= 0xffffffff) { const b = Buffer.alloc(5); b[0] = 0xce; b.writeUInt32BE(n, 1); out.push(b); }
  else if (n >= -0x80000000 && n < 0) { const b = Buffer.alloc(5); b[0] = 0xd2; b.writeInt32BE(n, 1); out.push(b); }
  else packInt(out, BigInt(n));
}

function packLength(out, len, fix, fixMax, codes) {
  // str/bin/array/map headers: a fix form when there is one, else 8/16/32-bit lengths.
  if (fix !== null && len <= fixMax) out.push(Buffer.from([fix | len]));
  else if (codes[0] !== null && len <= 0xff) out.push(Buffer.from([codes[0], len]));
  else if (len <= 0xffff) { const b = Buffer.alloc(3); b[0] = codes[1]; b.writeUInt16BE(len, 1); out.push(b); }
  else { const b = Buffer.alloc(5); b[0] = codes[2]; b.writeUInt32BE(len, 1); out.push(b); }
}

function packValue(out, v) {
  if (v === null || v === undefined) out.push(Buffer.from([0xc0]));
  else if (v === false || v === true) out.push(Buffer.from([v ? 0xc3 : 0xc2]));
  else if (v instanceof Float64 || (typeof v === 'number' && !Number.isInteger(v))) {
    const b = Buffer.alloc(9); b[0] = 0xcb; b.writeDoubleBE(v instanceof Float64 ? v.value : v, 1); out.push(b);
  } else if (typeof v === 'number' || typeof v === 'bigint') packInt(out, v);
  else if (typeof v === 'string') {
    const s = Buffer.from(v, 'utf8');
    packLength(out, s.length, 0xa0, 31, [0xd9, 0xda, 0xdb]); out.push(s);
  } else if (v instanceof Uint8Array) {
    packLength(out, v.length, null, 0, [0xc4, 0xc5, 0xc6]); out.push(Buffer.from(v));
  } else if (Array.isArray(v)) {
    packLength(out, v.length, 0x90, 15, [null, 0xdc, 0xdd]); for (const x of v) packValue(out, x);
  } else {
    const keys = Object.keys(v);
    packLength(out, keys.length, 0x80, 15, [null, 0xde, 0xdf]);
    for (const k of keys) { packValue(out, k); packValue(out, v[k]); }
  }
}

function msgpackEncode(v) { const out = []; packValue(out, v); return Buffer.concat(out); }

/** Decodes exactly one value filling all of `buf`; anything else is a protocol error. */
function msgpackDecode(buf) {
  let pos = 0;
  const need = (n) => { if (pos + n > buf.length) throw new ProtocolBroken('truncated msgpack'); };
  const u8 = () => { need(1); return buf[pos++]; };
  const u16 = () => { need(2); pos += 2; return buf.readUInt16BE(pos - 2); };
  const u32 = () => { need(4); pos += 4; return buf.readUInt32BE(pos - 4); };
  const bytes = (n, max) => {
    if (n > max) throw new ProtocolBroken(`msgpack str/bin of ${n} bytes over the limit`, 'limit_exceeded');
    need(n); pos += n; return buf.subarray(pos - n, pos);
  };
  const big = (b) => (b >= BigInt(Number.MIN_SAFE_INTEGER) && b <= BigInt(Number.MAX_SAFE_INTEGER) ? Number(b) : b);
  const str = (n) => {
    try { return new TextDecoder('utf-8', { fatal: true }).decode(bytes(n, MAX_STR)); } catch (e) {
      if (e instanceof ProtocolBroken) throw e; throw new ProtocolBroken('msgpack str is not UTF-8');
    }
  };
  const array = (n, depth) => {
    if (n > MAX_ARRAY) throw new ProtocolBroken(`msgpack array of ${n} over the limit`, 'limit_exceeded');
    const a = []; for (let i = 0; i < n; i++) a.push(value(depth + 1)); return a;
  };
  const map = (n, depth) => {
    if (n > MAX_MAP) throw new ProtocolBroken(`msgpack map of ${n} over the limit`, 'limit_exceeded');
    const m = Object.create(null);
    for (let i = 0; i < n; i++) {
      const k = value(depth + 1);
      if (typeof k !== 'string') throw new ProtocolBroken('msgpack map key is not a str');
      if (k in m) throw new ProtocolBroken(`msgpack map repeats key ${k}`);
      m[k] = value(depth + 1);
    }
    return m;
  };
  function value(depth) {
    if (depth > MAX_DEPTH + 1) throw new ProtocolBroken('msgpack nested too deep');
    const t = u8();
    if (t <= 0x7f) return t;
    if (t >= 0xe0) return t - 0x100;
    if ((t & 0xe0) === 0xa0) return str(t & 0x1f);
    if ((t & 0xf0) === 0x90) return array(t & 0x0f, depth);
    if ((t & 0xf0) === 0x80) return map(t & 0x0f, depth);
    switch (t) {
      case 0xc0: return null;
      case 0xc2: return false;
      case 0xc3: return true;
      case 0xc4: return Buffer.from(bytes(u8(), MAX_BIN));
      case 0xc5: return Buffer.from(bytes(u16(), MAX_BIN));
      case 0xc6: return Buffer.from(bytes(u32(), MAX_BIN));
      case 0xca: need(4); pos += 4; return buf.readFloatBE(pos - 4);
      case 0xcb: need(8); pos += 8; return buf.readDoubleBE(pos - 8);
      case 0xcc: return u8();
      case 0xcd: return u16();
      case 0xce: return u32();
      case 0xcf: need(8); pos += 8; return big(buf.readBigUInt64BE(pos - 8));
      case 0xd0: need(1); pos += 1; return buf.readInt8(pos - 1);
      case 0xd1: need(2); pos += 2; return buf.readInt16BE(pos - 2);
      case 0xd2: need(4); pos += 4; return buf.readInt32BE(pos - 4);
      case 0xd3: need(8); pos += 8; return big(buf.readBigInt64BE(pos - 8));
      case 0xd9: return str(u8());
      case 0xda: return str(u16());
      case 0xdb: return str(u32());
      case 0xdc: return array(u16(), depth);
      case 0xdd: return array(u32(), depth);
      case 0xde: return map(u16(), depth);
      case 0xdf: return map(u32(), depth);
      default: throw new ProtocolBroken(`msgpack type 0x${t.toString(16)} refused (extension or unused)`);
    }
  }
  const v = value(0);
  if (pos !== buf.length) throw new ProtocolBroken('trailing bytes after the msgpack map');
  return v;
}

// ---------------------------------------------------------------------------------------------
// LZ4 block decompression (section 1.2, codec 1), bounded by raw_len.

function lz4Decompress(src, rawLen) {
  const dst = Buffer.alloc(rawLen);
  let s = 0, d = 0;
  const bad = (why) => new ProtocolBroken(`bad lz4 data: ${why}`);
  const longLength = (n) => {  // a 15 in the token continues with bytes until one is not 255
    if (n !== 15) return n;
    let b;
    do { if (s >= src.length) throw bad('truncated length'); b = src[s++]; n += b; } while (b === 255);
    return n;
  };
  while (true) {
    if (s >= src.length) throw bad('missing sequence');
    const token = src[s++];
    const lit = longLength(token >> 4);
    if (s + lit > src.length || d + lit > rawLen) throw bad('literals overrun');
    src.copy(dst, d, s, s + lit); s += lit; d += lit;
    if (s === src.length) break;  // the last sequence has literals only
    if (s + 2 > src.length) throw bad('truncated offset');
    const offset = src[s] | (src[s + 1] << 8); s += 2;
    if (offset === 0 || offset > d) throw bad('offset out of range');
    const len = longLength(token & 15) + 4;
    if (d + len > rawLen) throw bad('match overruns raw_len');
    for (let i = 0; i < len; i++, d++) dst[d] = dst[d - offset];  // byte by byte: matches may overlap
  }
  if (d !== rawLen) throw bad(`${d} bytes instead of raw_len ${rawLen}`);
  return dst;
}

// ---------------------------------------------------------------------------------------------
// Frames and messages (sections 1, 2, 3).

const MAGIC = Buffer.from('MNPS', 'ascii');
const VERSION = 4;
const MAX_FRAME = 512 * 1024 * 1024, MAX_META = 1024 * 1024, MAX_BUFFERS = 16, MAX_RAW = 512 * 1024 * 1024;

const K = {
  HELLO: 1, CHALLENGE: 2, AUTH: 3, WELCOME: 4, REFUSE: 5, ASSIGN: 6, STATS: 7, PUSH: 8, ACK: 9,
  PULL: 10, WEIGHTS: 11, HEARTBEAT: 12, LEAVE: 13, ERROR: 14, EXCHANGE: 15, EXCHANGE_REPLY: 16,
  GLOBAL_WEIGHTS: 17, INIT_WEIGHTS: 18,
};
const NAME = Object.fromEntries(Object.entries(K).map(([n, k]) => [k, n]));

// The keys of each kind's map with their section 2 type: checked on every received message.
const STATS_KEYS = { clock: 'int', step_time: 'float>=0', loss: 'float', samples: 'int' };
const SCHEMA = {
  [K.HELLO]: { role: 'name', worker_id: 'id', nonce: 'nonce', capabilities: 'array', address: 'text', group: 'id' },
  [K.CHALLENGE]: { nonce: 'nonce' },
  [K.AUTH]: { mac: 'mac' },
  [K.WELCOME]: { worker_id: 'id', mac: 'mac', info: 'map' },
  [K.REFUSE]: { code: 'name', reason: 'text' },
  [K.ASSIGN]: { group: 'int', address: 'text', ratio: 'ratio', staleness: 'id' },
  [K.STATS]: STATS_KEYS,
  [K.PUSH]: { ...STATS_KEYS, encoding: 'name', codec: 'map' },
  [K.ACK]: { clock: 'int', version: 'int' },
  [K.PULL]: { clock: 'int', since: 'id' },
  [K.WEIGHTS]: { version: 'int', since: 'id', encoding: 'name', codec: 'map', done: 'bool', group: 'id',
    waited_for: 'array', ratio: 'ratio', lead: 'sint', min_clock: 'id', drift: 'float',
    lr_factor: 'float>=0', progress: 'ratio' },
  [K.HEARTBEAT]: { seq: 'int' },
  [K.LEAVE]: { reason: 'text' },
  [K.ERROR]: { code: 'name', reason: 'text' },
  [K.EXCHANGE]: { session: 'int', seq: 'int', version: 'int', final: 'bool', pushes: 'int', samples: 'int',
    step_time: 'float>=0', loss: 'float', iter_time: 'float>=0', bytes_in: 'int', bytes_out: 'int',
    min_clock: 'id', max_clock: 'id', pull_workers: 'array', pull_leads: 'array',
    pull_waits_us: 'array', encoding: 'name', codec: 'map' },
  [K.EXCHANGE_REPLY]: { version: 'int', done: 'bool', samples: 'int', saved_exchanges: 'array',
    encoding: 'name', codec: 'map' },
  [K.GLOBAL_WEIGHTS]: { version: 'int', done: 'bool', size: 'int', samples: 'int', t: 'float',
    train_s: 'float>=0', done_reason: 'name', bytes_up: 'int', bytes_down: 'int', members: 'array',
    last_exchange: 'array', encoding: 'name', codec: 'map' },
  [K.INIT_WEIGHTS]: { size: 'int', encoding: 'name', codec: 'map' },
};
const WITH_BUFFERS = new Set([K.PUSH, K.WEIGHTS, K.EXCHANGE, K.EXCHANGE_REPLY, K.GLOBAL_WEIGHTS,
  K.INIT_WEIGHTS]);
const SERVER_KINDS = new Set([K.CHALLENGE, K.WELCOME, K.REFUSE, K.ASSIGN, K.ACK, K.WEIGHTS,
  K.EXCHANGE_REPLY, K.GLOBAL_WEIGHTS, K.HEARTBEAT, K.LEAVE, K.ERROR]);
const MAX_INT = 2n ** 63n - 1n;

function isInt(v, min) {
  if (typeof v === 'bigint') return v >= BigInt(min) && v <= MAX_INT;
  return Number.isInteger(v) && v >= min;
}

function typeOk(type, v) {
  const len = (s) => [...s].length;  // characters, not UTF-16 units
  switch (type) {
    case 'int': return isInt(v, 0);
    case 'id': return isInt(v, -1);
    case 'sint': return isInt(v, Number.MIN_SAFE_INTEGER) || (typeof v === 'bigint' && v >= -MAX_INT);
    case 'float': return typeof v === 'number' && Number.isFinite(v);
    case 'float>=0': return typeof v === 'number' && Number.isFinite(v) && v >= 0;
    case 'ratio': return typeof v === 'number' && v >= 0 && v <= 1;
    case 'name': return typeof v === 'string' && len(v) <= 64;
    case 'text': return typeof v === 'string' && len(v) <= 4096;
    case 'bool': return typeof v === 'boolean';
    case 'map': return v !== null && typeof v === 'object' && !Array.isArray(v) && !Buffer.isBuffer(v);
    case 'array': return Array.isArray(v);
    case 'nonce': return Buffer.isBuffer(v) && v.length === 32;
    case 'mac': return Buffer.isBuffer(v) && (v.length === 0 || v.length === 32);
    default: throw new Error(`unknown type ${type}`);
  }
}

/** Exactly the kind's keys (section 1.3), each of its type (section 2). */
function checkMeta(kind, meta) {
  const schema = SCHEMA[kind];
  if (!typeOk('map', meta)) throw new ProtocolBroken(`${NAME[kind]}: meta is not a map`);
  const want = Object.keys(schema).sort().join(','), got = Object.keys(meta).sort().join(',');
  if (want !== got) throw new ProtocolBroken(`${NAME[kind]}: keys ${got}, expected ${want}`);
  for (const [key, type] of Object.entries(schema)) {
    if (!typeOk(type, meta[key])) throw new ProtocolBroken(`${NAME[kind]}: ${key} is not a ${type}`);
  }
}

/** One frame: prefix, buffer table, msgpack map, body (raw buffers only: we never compress). */
function encodeFrame(kind, meta, buffers = []) {
  const metaBytes = msgpackEncode(meta);
  const prefix = Buffer.alloc(16);
  MAGIC.copy(prefix, 0);
  prefix[4] = VERSION; prefix[5] = kind; prefix[6] = buffers.length; prefix[7] = 0;
  prefix.writeUInt32LE(metaBytes.length, 8);
  prefix.writeUInt32LE(buffers.reduce((n, b) => n + b.length, 0), 12);
  const table = Buffer.alloc(12 * buffers.length);
  buffers.forEach((b, i) => {  // codec 0 (raw), three zero padding bytes, wire_len = raw_len
    table.writeUInt32LE(b.length, 12 * i + 4); table.writeUInt32LE(b.length, 12 * i + 8);
  });
  return Buffer.concat([prefix, table, metaBytes, ...buffers]);
}

/** The 16-byte prefix, checked against the limits before anything else is read (section 1.1). */
function parsePrefix(p) {
  if (!p.subarray(0, 4).equals(MAGIC)) throw new ProtocolBroken(`bad magic ${p.subarray(0, 4).toString('hex')}`);
  const version = p[4], kind = p[5], nbuf = p[6], flags = p[7];
  const metaLen = p.readUInt32LE(8), bodyLen = p.readUInt32LE(12);
  if (!(kind in NAME)) throw new ProtocolBroken(`unknown kind ${kind}`);
  // HELLO, REFUSE and ERROR keep their layout in every version, so we read them whatever it says.
  if (version !== VERSION && ![K.HELLO, K.REFUSE, K.ERROR].includes(kind)) {
    throw new ProtocolBroken(`${NAME[kind]} with protocol version ${version}`);
  }
  if (flags !== 0) throw new ProtocolBroken(`nonzero flags ${flags}`);
  if (nbuf > MAX_BUFFERS) throw new ProtocolBroken(`${nbuf} buffers, limit ${MAX_BUFFERS}`, 'limit_exceeded');
  if (nbuf > 0 && !WITH_BUFFERS.has(kind)) throw new ProtocolBroken(`${NAME[kind]} with buffers`);
  if (metaLen > MAX_META) throw new ProtocolBroken(`meta of ${metaLen} bytes, limit ${MAX_META}`, 'limit_exceeded');
  if (16 + 12 * nbuf + metaLen + bodyLen > MAX_FRAME) {
    throw new ProtocolBroken('frame over the size limit', 'limit_exceeded');
  }
  return { kind, nbuf, metaLen, bodyLen };
}

function parseTable(t, nbuf, bodyLen) {
  const entries = [];
  let wire = 0, raw = 0;
  for (let i = 0; i < nbuf; i++) {
    const codec = t[12 * i], wireLen = t.readUInt32LE(12 * i + 4), rawLen = t.readUInt32LE(12 * i + 8);
    if (codec !== 0 && codec !== 1) throw new ProtocolBroken(`buffer ${i}: unknown codec ${codec}`);
    if (codec === 0 && wireLen !== rawLen) throw new ProtocolBroken(`buffer ${i}: raw with wire_len != raw_len`);
    entries.push({ codec, wireLen, rawLen });
    wire += wireLen; raw += rawLen;
  }
  if (wire !== bodyLen) throw new ProtocolBroken(`buffer table adds up to ${wire}, body_len is ${bodyLen}`);
  if (raw > MAX_RAW) throw new ProtocolBroken('raw buffers over the size limit', 'limit_exceeded');
  return entries;
}

// ---------------------------------------------------------------------------------------------
// A connection: exact reads over a socket, frames in and out, and the state of section 4.

class Connection {
  constructor(socket, where) {
    this.socket = socket; this.where = where;
    this.chunks = []; this.have = 0; this.ended = false; this.error = null; this.wake = null;
    this.state = 'START'; this.pending = null; this.seq = 0;
    socket.on('data', (c) => { this.chunks.push(c); this.have += c.length; this.notify(); });
    socket.on('end', () => { this.ended = true; this.notify(); });
    socket.on('close', () => { this.ended = true; this.notify(); });
    socket.on('error', (e) => { this.error = e; this.notify(); });
  }

  static open(host, port, timeoutMs) {
    const where = `${host}:${port}`;
    return new Promise((resolve, reject) => {
      const socket = net.connect({ host, port, noDelay: true });
      const fail = (why) => {
        clearTimeout(timer); socket.destroy(); reject(new ConnectionFailed(`cannot talk to ${where}: ${why}`));
      };
      const timer = setTimeout(() => fail('connect timed out'), timeoutMs);
      socket.once('error', (e) => fail(e.message));
      socket.once('connect', () => {
        clearTimeout(timer); socket.removeAllListeners('error'); resolve(new Connection(socket, where));
      });
    });
  }

  notify() { const w = this.wake; this.wake = null; if (w) w(); }

  /** Exactly n bytes; `inFrame` says whether an end now cuts a frame (protocol) or not (connection). */
  async readExactly(n, inFrame) {
    while (this.have < n) {
      if (this.error) throw new ConnectionFailed(`connection to ${this.where} failed: ${this.error.message}`);
      if (this.ended) {
        if (inFrame || this.have > 0) throw new ProtocolBroken(`${this.where} closed the connection mid-frame`);
        throw new ConnectionFailed(`${this.where} closed the connection (state ${this.state})`);
      }
      await new Promise((r) => { this.wake = r; });
    }
    const all = this.chunks.length === 1 ? this.chunks[0] : Buffer.concat(this.chunks);
    const out = all.subarray(0, n), rest = all.subarray(n);
    this.chunks = rest.length ? [rest] : []; this.have = rest.length;
    return out;
  }

  async readMessage() {
    const prefix = parsePrefix(await this.readExactly(16, false));
    const table = parseTable(await this.readExactly(12 * prefix.nbuf, true), prefix.nbuf, prefix.bodyLen);
    const meta = msgpackDecode(await this.readExactly(prefix.metaLen, true));
    const buffers = [];
    for (const [i, e] of table.entries()) {
      const wire = Buffer.from(await this.readExactly(e.wireLen, true));
      if (e.codec === 0) buffers.push(wire);
      else {
        try { buffers.push(lz4Decompress(wire, e.rawLen)); } catch (err) {
          throw new ProtocolBroken(`buffer ${i}: ${err.message}`);
        }
      }
    }
    checkMeta(prefix.kind, meta);
    this.received(prefix.kind, meta);
    return { kind: prefix.kind, meta, buffers };
  }

  /** Section 4, the server's side of the table: which kind may come in this state. */
  received(kind, meta) {
    const name = NAME[kind];
    if (!SERVER_KINDS.has(kind)) throw new ProtocolBroken(`${name} sent by the server (a client's message)`);
    const allowed = { HELLO: ['CHALLENGE', 'REFUSE'], AUTH: ['WELCOME', 'REFUSE'],
      OPEN: ['ASSIGN', 'ACK', 'WEIGHTS', 'EXCHANGE_REPLY', 'GLOBAL_WEIGHTS', 'HEARTBEAT', 'LEAVE'] }[this.state] ?? [];
    if (kind === K.ERROR) {
      this.state = 'CLOSED';
      throw new Refused(`error from server: ${meta.code}: ${meta.reason}`);
    }
    if (!allowed.includes(name)) throw new ProtocolBroken(`${name} in state ${this.state}`);
    if (kind === K.REFUSE) { this.state = 'CLOSED'; throw new Refused(`refused: ${meta.code}: ${meta.reason}`); }
    if (kind === K.CHALLENGE) this.state = 'CHALLENGE';
    if (kind === K.WELCOME) this.state = 'OPEN';
  }

  send(kind, meta, buffers = []) {
    if (this.socket.destroyed) return;
    this.socket.write(encodeFrame(kind, meta, buffers));
    if (kind === K.HELLO) this.state = 'HELLO';
    if (kind === K.AUTH) this.state = 'AUTH';
    if (kind === K.ERROR) this.state = 'CLOSED';
  }

  heartbeat() { this.send(K.HEARTBEAT, { seq: this.seq++ }); }

  /** The next message, or null after timeoutMs; a frame half read stays pending for the next call. */
  async next(timeoutMs) {
    if (!this.pending) this.pending = this.readMessage().finally(() => { this.pending = null; });
    let timer;
    const timeout = new Promise((r) => { timer = setTimeout(() => r(null), timeoutMs); });
    try { return await Promise.race([this.pending, timeout]); } finally { clearTimeout(timer); }
  }

  /**
   * Waits for one of `kinds`, answering nothing to HEARTBEAT (its bytes are what keeps the lease)
   * and calling `tick` every tickMs, e.g. to send STATS or HEARTBEAT; gives up after timeoutMs.
   */
  async expect(kinds, { timeoutMs = 60_000, tickMs = 1_000, tick = () => this.heartbeat() } = {}) {
    const deadline = Date.now() + timeoutMs;
    const wanted = kinds.map((k) => NAME[k]).join('/');
    while (true) {
      const left = deadline - Date.now();
      if (left <= 0) throw new ConnectionFailed(`no ${wanted} from ${this.where} in ${timeoutMs / 1000} s`);
      const msg = await this.next(Math.min(left, tickMs));
      if (msg === null) { tick(); continue; }
      if (kinds.includes(msg.kind)) return msg;
      if (msg.kind === K.HEARTBEAT) continue;
      if (msg.kind === K.LEAVE) throw new Refused(`server left: ${msg.meta.reason}`);
      // ASSIGN/ACK/WEIGHTS out of turn: well formed, but not what this session allows now.
      throw new ProtocolBroken(`unexpected ${NAME[msg.kind]} while waiting for ${wanted}`);
    }
  }

  /** LEAVE, a clean goodbye; then we close (section 6). */
  async leave(reason = 'done') {
    if (this.state === 'OPEN') this.send(K.LEAVE, { reason });
    await this.close();
  }

  /** After a failure: ERROR for a frame or message we refuse (section 8, step 4), then close. */
  async hangUp(err) {
    if (err instanceof ProtocolBroken && this.state !== 'CLOSED') {
      this.send(K.ERROR, { code: err.code, reason: err.message.slice(0, 4096) });
    }
    await this.close();
  }

  /** Ends our side, so what we wrote still goes out, and waits (briefly) for the server's side. */
  async close() {
    this.state = 'CLOSED';
    if (this.socket.destroyed) return;
    const closed = new Promise((r) => {
      const t = setTimeout(r, 2000);
      this.socket.once('close', () => { clearTimeout(t); r(); });
    });
    this.socket.end();
    await closed;
    this.socket.destroy();
  }
}

// ---------------------------------------------------------------------------------------------
// Handshake (section 5).

function transcript(label, role, workerId, nonceC, nonceS) {
  const head = Buffer.alloc(2 + role.length);
  head[0] = VERSION; head[1] = role.length; head.write(role, 2, 'ascii');
  const id = Buffer.alloc(8); id.writeBigInt64LE(BigInt(workerId));
  return Buffer.concat([Buffer.from(label, 'ascii'), head, id, nonceC, nonceS]);
}

function hmac(secret, data) { return crypto.createHmac('sha256', secret).update(data).digest(); }

/** Dials, says HELLO and proves the secret; returns the open connection and WELCOME's map. */
async function openSession(host, port, hello, secret, timeoutMs) {
  const conn = await Connection.open(host, port, timeoutMs);
  const nonceC = crypto.randomBytes(32);
  conn.send(K.HELLO, { capabilities: [], address: '', group: -1, ...hello, nonce: nonceC });
  try {
    const challenge = await conn.expect([K.CHALLENGE], { timeoutMs: 10_000, tick: () => {} });
    const nonceS = challenge.meta.nonce;
    const proof = (label) => hmac(secret, transcript(label, hello.role, hello.worker_id, nonceC, nonceS));
    conn.send(K.AUTH, { mac: secret.length ? proof('minips-client-v1\0') : Buffer.alloc(0) });
    const welcome = await conn.expect([K.WELCOME], { timeoutMs: 10_000, tick: () => {} });
    if (secret.length) {
      // The server must show that it knows the secret too; a server without one sends no mac.
      const macS = welcome.meta.mac;
      if (macS.length === 0) throw new Refused('refused: server has no secret (empty mac in WELCOME)');
      if (!crypto.timingSafeEqual(macS, proof('minips-server-v1\0'))) {
        throw new Refused('refused: server failed to prove the secret (wrong mac in WELCOME)');
      }
    }
    return { conn, welcome: welcome.meta };
  } catch (e) { await conn.hangUp(e); throw e; }
}

// ---------------------------------------------------------------------------------------------
// Weights: dense-f32 (or dense-f16) buffers to a Float32Array.

function halfToFloat(h) {
  const sign = h & 0x8000 ? -1 : 1, exp = (h >> 10) & 0x1f, frac = h & 0x3ff;
  if (exp === 0) return sign * frac * 2 ** -24;
  if (exp === 31) return frac ? NaN : sign * Infinity;
  return sign * (1 + frac / 1024) * 2 ** (exp - 15);
}

/** The weights of a WEIGHTS or GLOBAL_WEIGHTS message, after checking that its buffers say what
 * `encoding` says. */
function weightsOf(msg) {
  const { encoding, since, size } = msg.meta;
  // we keep no copy (PULL since -1), so the server owes us the whole weights (section 3)
  if (since !== undefined && since !== -1) {
    throw new ProtocolBroken(`WEIGHTS is an update since ${since}; we pulled with since -1`);
  }
  if (msg.buffers.length !== 1) {
    throw new ProtocolBroken(`WEIGHTS ${encoding} with ${msg.buffers.length} buffers, expected 1`);
  }
  const buf = msg.buffers[0];
  const width = { 'dense-f32': 4, 'dense-f16': 2 }[encoding];
  if (!width) throw new ProtocolBroken(`WEIGHTS with encoding ${encoding}, not a dense one`);
  if (buf.length % width) throw new ProtocolBroken(`${encoding} buffer of ${buf.length} bytes`);
  const n = buf.length / width;
  if (size !== undefined && size !== n) throw new ProtocolBroken(`GLOBAL_WEIGHTS size ${size}, buffer holds ${n}`);
  const w = new Float32Array(n);
  for (let i = 0; i < n; i++) w[i] = width === 4 ? buf.readFloatLE(4 * i) : halfToFloat(buf.readUInt16LE(2 * i));
  return { weights: w, raw: width === 4 ? buf : null };
}

function float32Bytes(w) {  // little-endian whatever the host's order is
  const b = Buffer.alloc(4 * w.length);
  for (let i = 0; i < w.length; i++) b.writeFloatLE(w[i], 4 * i);
  return b;
}

// ---------------------------------------------------------------------------------------------
// The two roles (section 9).

async function evaluator(opts, secret) {
  const { conn } = await openSession(opts.host, opts.port,
    { role: 'evaluator', worker_id: -1, group: -1 }, secret, opts.timeoutMs);
  try {
    conn.send(K.PULL, { clock: 0, since: -1 });
    const msg = await conn.expect([K.GLOBAL_WEIGHTS], { timeoutMs: opts.timeoutMs });
    const { weights, raw } = weightsOf(msg);
    if (opts.out) fs.writeFileSync(opts.out, raw ?? float32Bytes(weights));
    const { encoding, codec, ...counters } = msg.meta;  // the run's counters (section 3)
    console.log(JSON.stringify({ encoding, params: weights.length,
      version: msg.meta.version, done: msg.meta.done, info: plain(counters) }));
    await conn.leave();
  } catch (e) { await conn.hangUp(e); throw e; }
}

/** Where ASSIGN's address points; no host means the host we dialled (section 9, step 4). */
function groupAddress(address, dialled) {
  const m = /^(?:\[([^\]]*)\]|([^:]*)):(\d+)$/.exec(address);
  if (!m) throw new ProtocolBroken(`ASSIGN address ${JSON.stringify(address)} is not host:port`);
  const host = m[1] ?? m[2];
  return { host: host || dialled, port: Number(m[3]) };
}

/** k distinct coordinates in increasing order, with values of random sign, |g| in [0.5, 1.5). */
function madeUpGradient(n, k) {
  const picked = new Set();
  while (picked.size < k) picked.add(crypto.randomInt(n));
  const index = Uint32Array.from([...picked].sort((a, b) => a - b));
  const value = Float32Array.from(index, () => (crypto.randomInt(2) ? 1 : -1) * (0.5 + Math.random()));
  return { index, value };
}

function sparseV1(grad) {
  const idx = Buffer.alloc(4 * grad.index.length), val = Buffer.alloc(4 * grad.value.length);
  grad.index.forEach((x, i) => idx.writeUInt32LE(x, 4 * i));
  grad.value.forEach((x, i) => val.writeFloatLE(x, 4 * i));
  return { codec: { k: grad.index.length, index: 'u32', value: 'f32' }, buffers: [idx, val] };
}

/** The control channel: STATS every second (and HEARTBEAT every heartbeat_s) until ASSIGN. */
async function untilAssigned(opts, secret) {
  const { conn, welcome } = await openSession(opts.host, opts.port,
    { role: 'worker', worker_id: -1, group: -1 }, secret, opts.timeoutMs);
  if (welcome.info.need_init === true) {
    await conn.leave('this client has no initial weights');
    throw new Refused('refused: the server needs initial weights (start it with --init)');
  }
  const heartbeatMs = 1000 * (Number(welcome.info.heartbeat_s) || 1);
  let lastBeat = Date.now();
  const stats = () => conn.send(K.STATS,
    { clock: 0, step_time: new Float64(0.05), loss: new Float64(2.3), samples: 64 });
  stats();
  let assign;
  try {
    assign = await conn.expect([K.ASSIGN], { timeoutMs: opts.timeoutMs, tick: () => {
      stats();
      if (Date.now() - lastBeat >= heartbeatMs) { conn.heartbeat(); lastBeat = Date.now(); }
    } });
  } catch (e) { await conn.hangUp(e); throw e; }
  return { control: conn, workerId: welcome.worker_id, assign: assign.meta, heartbeatMs };
}

async function worker(opts, secret) {
  const { control, workerId, assign, heartbeatMs } = await untilAssigned(opts, secret);
  let group = null;
  try {
    const where = groupAddress(assign.address, opts.host);
    ({ conn: group } = await openSession(where.host, where.port,
      { role: 'worker', worker_id: workerId, group: assign.group }, secret, opts.timeoutMs));
    const wait = (kind) => group.expect([kind], { timeoutMs: opts.timeoutMs, tickMs: heartbeatMs });
    const c = (await wait(K.ACK)).meta.clock;  // the group's clock: where this worker starts
    group.send(K.PULL, { clock: c, since: -1 });
    const first = await wait(K.WEIGHTS);
    if (first.meta.done) throw new Refused('server says training is over (WEIGHTS done)');
    const before = weightsOf(first).weights;

    const grad = madeUpGradient(before.length, Math.min(opts.k, before.length));
    const sparse = sparseV1(grad);
    group.send(K.PUSH, { clock: c + 1, step_time: new Float64(0.05), loss: new Float64(2.3), samples: 64,
      encoding: 'sparse-v1', codec: sparse.codec }, sparse.buffers);
    const ack = await wait(K.ACK);
    if (ack.meta.clock !== c + 1) throw new ProtocolBroken(`ACK clock ${ack.meta.clock}, pushed ${c + 1}`);
    group.send(K.PULL, { clock: c + 1, since: -1 });
    const second = await wait(K.WEIGHTS);
    const after = weightsOf(second).weights;
    if (after.length !== before.length) throw new ProtocolBroken('the weights changed size');
    if (opts.out) fs.writeFileSync(opts.out, float32Bytes(after));
    console.log(JSON.stringify({ worker_id: workerId, group: assign.group, ratio: assign.ratio,
      clock: c + 1, version: ack.meta.version, params: after.length, k: grad.index.length,
      ...moved(before, after, grad), pushed: Array.from(grad.index), signs: Array.from(grad.value, Math.sign) }));
    await group.leave();
    await control.leave();
  } catch (e) {
    await group?.hangUp(e);
    await control.leave(`group server: ${e.message}`.slice(0, 4096));  // not the global server's fault
    throw e;
  }
}

/** Which weights moved, whether only pushed ones did, and whether each moved against its gradient. */
function moved(before, after, grad) {
  const pushed = new Map(Array.from(grad.index, (x, i) => [x, grad.value[i]]));
  let count = 0, onlyPushed = true, against = true;
  for (let i = 0; i < before.length; i++) {
    if (before[i] === after[i]) continue;
    count++;
    const g = pushed.get(i);
    if (g === undefined) onlyPushed = false;
    else if (Math.sign(after[i] - before[i]) !== -Math.sign(g)) against = false;
  }
  return { moved: count, moved_only_where_pushed: onlyPushed, moved_against_the_gradient: against };
}

/** A msgpack map as JSON can print it (bin as hex, BigInt as string). */
function plain(v) {
  return JSON.parse(JSON.stringify(v, (_, x) => (typeof x === 'bigint' ? x.toString()
    : x && x.type === 'Buffer' && Array.isArray(x.data) ? Buffer.from(x.data).toString('hex') : x)));
}

// ---------------------------------------------------------------------------------------------
// Command line.

function parseArgs(argv) {
  const usage = 'usage: node node_client.mjs HOST PORT [--out FILE] [--worker] [--k N] [--timeout S]';
  const opts = { out: null, worker: false, k: 50, timeoutMs: 60_000 };
  const positional = [];
  for (let i = 0; i < argv.length; i++) {
    const a = argv[i];
    const value = () => { if (i + 1 >= argv.length) throw new Error(`${a} needs a value`); return argv[++i]; };
    if (a === '--worker') opts.worker = true;
    else if (a === '--out') opts.out = value();
    else if (a === '--k') opts.k = Number(value());
    else if (a === '--timeout') opts.timeoutMs = 1000 * Number(value());
    else if (a === '-h' || a === '--help') { console.log(usage); process.exit(0); }
    else if (a.startsWith('-')) throw new Error(`unknown option ${a}\n${usage}`);
    else positional.push(a);
  }
  if (positional.length !== 2) throw new Error(usage);
  [opts.host, opts.port] = [positional[0], Number(positional[1])];
  if (!Number.isInteger(opts.port) || opts.port < 1 || opts.port > 65535) {
    throw new Error(`bad port ${positional[1]}`);
  }
  if (!Number.isInteger(opts.k) || opts.k < 1) throw new Error(`--k must be a positive integer`);
  if (!(opts.timeoutMs > 0)) throw new Error('--timeout must be positive');
  return opts;
}

async function main() {
  let opts;
  try { opts = parseArgs(process.argv.slice(2)); } catch (e) { process.stderr.write(`${e.message}\n`); return 2; }
  const secret = Buffer.from(process.env.MINIPS_TOKEN ?? '', 'utf8');  // empty: no secret
  try {
    await (opts.worker ? worker(opts, secret) : evaluator(opts, secret));
    return 0;
  } catch (e) {
    const where = `${opts.host}:${opts.port}`;
    if (e instanceof Refused) { process.stderr.write(`${e.message}\n`); return 1; }
    if (e instanceof ProtocolBroken) { process.stderr.write(`protocol error from ${where}: ${e.message}\n`); return 2; }
    if (e instanceof ConnectionFailed) { process.stderr.write(`${e.message}\n`); return 3; }
    if (e?.syscall) { process.stderr.write(`cannot talk to ${where}: ${e.message}\n`); return 3; }  // socket, late
    throw e;  // a bug in this client: let Node print it
  }
}

process.exit(await main());
