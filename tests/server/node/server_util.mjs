// Helpers for the end-to-end server tests: start `specula serve` as a child
// process on a free port, stop it (SIGTERM, exit code 0), raw HTTP requests,
// and the Prometheus text of GET /metrics parsed into numbers.
//
// The specula binary comes from $SPECULA_BIN (run.sh sets it).
import { spawn, execFile } from 'node:child_process';
import net from 'node:net';
import http from 'node:http';
import assert from 'node:assert/strict';

export const specula = () => {
  const bin = process.env.SPECULA_BIN;
  if (!bin) throw new Error('SPECULA_BIN is not set (run through tests/server/node/run.sh)');
  return bin;
};

// Children started here and not yet stopped: killed if the test process exits
// (a failing test must not leave a server behind).
const live = new Set();
process.on('exit', () => {
  for (const child of live) child.kill('SIGKILL');
});

// The CPU backend's thread team shares busy cores gracefully (README,
// Performance notes), so servers run with their default threads.
function childEnv() {
  return { ...process.env };
}

// Starts `specula serve --port 0 --host 127.0.0.1 ...args` and resolves once
// its stderr says "on http://127.0.0.1:PORT". Returns
//   { port, baseURL (http://127.0.0.1:PORT), stderr() (everything so far),
//     waitForLog(regex, ms), stop() }.
export async function startServer(args = [], { timeoutMs = 60_000 } = {}) {
  const child = spawn(specula(), ['serve', '--port', '0', '--host', '127.0.0.1', ...args], {
    stdio: ['ignore', 'pipe', 'pipe'],
    env: childEnv(),
  });
  live.add(child);
  let err = '';
  let out = '';
  let exited = null;  // { code, signal } once it exited
  const exitWaiters = [];
  const logWaiters = [];
  child.stdout.setEncoding('utf8');
  child.stderr.setEncoding('utf8');
  child.stdout.on('data', (d) => { out += d; });
  child.stderr.on('data', (d) => {
    err += d;
    for (const w of [...logWaiters]) w();
  });
  child.on('exit', (code, signal) => {
    exited = { code, signal };
    live.delete(child);
    for (const w of exitWaiters) w();
  });
  const waitExit = () => new Promise((resolve) => {
    if (exited) resolve(exited); else exitWaiters.push(() => resolve(exited));
  });
  const diag = () => `server ${[...args].join(' ')}\n--- stderr ---\n${err}--- stdout ---\n${out}`;

  const port = await new Promise((resolve, reject) => {
    const timer = setTimeout(() => {
      child.kill('SIGKILL');
      reject(new Error(`specula serve did not report its address within ${timeoutMs} ms\n${diag()}`));
    }, timeoutMs);
    const check = () => {
      const m = /on http:\/\/127\.0\.0\.1:(\d+)/.exec(err);
      if (m) {
        clearTimeout(timer);
        logWaiters.splice(logWaiters.indexOf(check), 1);
        resolve(Number(m[1]));
      }
    };
    logWaiters.push(check);
    exitWaiters.push(() => {
      clearTimeout(timer);
      reject(new Error(`specula serve exited before listening (${JSON.stringify(exited)})\n${diag()}`));
    });
    check();
  });

  return {
    port,
    baseURL: `http://127.0.0.1:${port}`,
    stderr: () => err,
    diag,
    alive: () => exited === null,
    // Resolves with the first match of `regex` in stderr, or rejects after ms.
    waitForLog(regex, ms = 5000) {
      return new Promise((resolve, reject) => {
        let timer;
        const check = () => {
          const m = regex.exec(err);
          if (m) {
            clearTimeout(timer);
            const i = logWaiters.indexOf(check);
            if (i >= 0) logWaiters.splice(i, 1);
            resolve(m);
          }
        };
        timer = setTimeout(() => {
          const i = logWaiters.indexOf(check);
          if (i >= 0) logWaiters.splice(i, 1);
          reject(new Error(`no stderr line matching ${regex} within ${ms} ms\n${diag()}`));
        }, ms);
        logWaiters.push(check);
        check();
      });
    },
    // SIGTERM, wait for the exit (20 s, then SIGKILL), and assert exit code 0.
    async stop() {
      if (!exited) {
        child.kill('SIGTERM');
        const timer = setTimeout(() => child.kill('SIGKILL'), 20_000);
        await waitExit();
        clearTimeout(timer);
      }
      assert.deepEqual(exited, { code: 0, signal: null }, `specula serve did not exit cleanly\n${diag()}`);
    },
  };
}

// Runs the specula binary with `args` and resolves with { stdout, stderr }.
export function runSpecula(args, { timeoutMs = 60_000 } = {}) {
  return new Promise((resolve, reject) => {
    execFile(specula(), args, { env: childEnv(), timeout: timeoutMs, maxBuffer: 64 << 20 },
      (error, stdout, stderr) => {
        if (error) reject(new Error(`specula ${args.join(' ')} failed: ${error.message}\n${stderr}`));
        else resolve({ stdout, stderr });
      });
  });
}

// A request through node:http. Resolves with
//   { status, headers, body (string), json (parsed body or undefined) }.
export function request(port, { method = 'GET', path = '/', headers = {}, body } = {}) {
  return new Promise((resolve, reject) => {
    const data = body === undefined ? undefined
      : Buffer.isBuffer(body) ? body
        : Buffer.from(typeof body === 'string' ? body : JSON.stringify(body));
    const h = { ...headers };
    if (data !== undefined) {
      h['content-type'] ??= 'application/json';
      h['content-length'] = data.length;
    }
    const req = http.request({ host: '127.0.0.1', port, method, path, headers: h, agent: false }, (res) => {
      const chunks = [];
      res.on('data', (c) => chunks.push(c));
      res.on('end', () => {
        const text = Buffer.concat(chunks).toString('utf8');
        let json;
        try { json = JSON.parse(text); } catch { json = undefined; }
        resolve({ status: res.statusCode, headers: res.headers, body: text, json });
      });
      res.on('error', reject);
    });
    req.on('error', reject);
    if (data !== undefined) req.write(data);
    req.end();
  });
}

// The server-sent events of a streamed body: the parsed JSON of each
// `data: {...}` event, and whether `data: [DONE]` ended it.
export function parseSse(body) {
  const events = [];
  let done = false;
  for (const block of body.split('\n\n')) {
    for (const line of block.split('\n')) {
      if (!line.startsWith('data:')) continue;
      const payload = line.slice(5).trim();
      if (payload === '[DONE]') done = true;
      else events.push(JSON.parse(payload));
    }
  }
  return { events, done };
}

// Parses one HTTP/1.1 response from `buf` (a Buffer), or returns null if it
// is not complete yet. Handles Content-Length and chunked bodies.
export function parseHttpResponse(buf) {
  const end = buf.indexOf('\r\n\r\n');
  if (end < 0) return null;
  const head = buf.subarray(0, end).toString('latin1').split('\r\n');
  const m = /^HTTP\/1\.[01] (\d{3})/.exec(head[0]);
  if (!m) throw new Error(`not an HTTP response: ${JSON.stringify(head[0])}`);
  const headers = {};
  for (const line of head.slice(1)) {
    const i = line.indexOf(':');
    headers[line.slice(0, i).trim().toLowerCase()] = line.slice(i + 1).trim();
  }
  let rest = buf.subarray(end + 4);
  let body;
  if (headers['transfer-encoding']?.toLowerCase() === 'chunked') {
    const parts = [];
    for (;;) {
      const le = rest.indexOf('\r\n');
      if (le < 0) return null;
      const size = parseInt(rest.subarray(0, le).toString('latin1'), 16);
      if (rest.length < le + 2 + size + 2) return null;
      if (size === 0) break;
      parts.push(rest.subarray(le + 2, le + 2 + size));
      rest = rest.subarray(le + 2 + size + 2);
    }
    body = Buffer.concat(parts);
  } else {
    const len = Number(headers['content-length'] ?? 0);
    if (rest.length < len) return null;
    body = rest.subarray(0, len);
  }
  const text = body.toString('utf8');
  let json;
  try { json = JSON.parse(text); } catch { json = undefined; }
  return { status: Number(m[1]), headers, body: text, json };
}

// Sends raw bytes over a TCP connection and resolves with the parsed response,
// or { closed: true, received } when the server closes the connection first.
// `pieces`: a Buffer/string sent at once, or an array sent `delayMs` apart.
export function rawRequest(port, pieces, { delayMs = 0, timeoutMs = 30_000 } = {}) {
  return new Promise((resolve, reject) => {
    const sock = net.connect(port, '127.0.0.1');
    let received = Buffer.alloc(0);
    let settled = false;
    const finish = (value, error) => {
      if (settled) return;
      settled = true;
      clearTimeout(timer);
      sock.destroy();
      if (error) reject(error); else resolve(value);
    };
    const timer = setTimeout(() => finish(undefined, new Error(`no response within ${timeoutMs} ms`)), timeoutMs);
    sock.on('data', (d) => {
      received = Buffer.concat([received, d]);
      let r;
      try { r = parseHttpResponse(received); } catch (e) { finish(undefined, e); return; }
      if (r) finish(r);
    });
    // A reset after (part of) a response still counts as the server's answer.
    const closed = () => finish({ closed: true, received: received.toString('latin1') });
    sock.on('end', closed);
    sock.on('close', closed);
    sock.on('error', closed);
    const list = Array.isArray(pieces) ? pieces : [pieces];
    sock.on('connect', async () => {
      for (const p of list) {
        if (settled || sock.destroyed) return;
        sock.write(p);
        if (delayMs) await new Promise((r) => setTimeout(r, delayMs));
      }
    });
  });
}

// A request's raw bytes: a POST with a JSON (or given) body.
export function rawPost(path, body, extraHeaders = '') {
  const data = Buffer.isBuffer(body) ? body : Buffer.from(typeof body === 'string' ? body : JSON.stringify(body));
  return Buffer.concat([
    Buffer.from(`POST ${path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n` +
      `Content-Length: ${data.length}\r\n${extraHeaders}\r\n`),
    data,
  ]);
}

// GET /metrics as { 'name' or 'name{labels}': value }.
export async function metrics(port) {
  const r = await request(port, { path: '/metrics' });
  assert.equal(r.status, 200, `GET /metrics: ${r.status} ${r.body}`);
  const out = {};
  for (const line of r.body.split('\n')) {
    if (!line || line.startsWith('#')) continue;
    const m = /^([A-Za-z_:][\w:]*(?:\{[^}]*\})?)\s+(\S+)/.exec(line);
    if (m) out[m[1]] = Number(m[2]);
  }
  return out;
}

// Asserts an OpenAI-style error body: {"error": {message, type, param, code}}.
export function assertErrorBody(r, { status, param, code } = {}) {
  const ctx = `status ${r.status}, body ${r.body}`;
  if (status !== undefined) assert.equal(r.status, status, ctx);
  assert.ok(r.json && typeof r.json === 'object', `error body is not JSON: ${ctx}`);
  const e = r.json.error;
  assert.ok(e && typeof e === 'object', `no "error" object: ${ctx}`);
  assert.equal(typeof e.message, 'string', ctx);
  assert.ok(e.message.length > 0, ctx);
  assert.equal(typeof e.type, 'string', ctx);
  assert.ok('param' in e && (e.param === null || typeof e.param === 'string'), `param: ${ctx}`);
  assert.ok('code' in e && (e.code === null || typeof e.code === 'string'), `code: ${ctx}`);
  if (param !== undefined) assert.equal(e.param, param, ctx);
  if (code !== undefined) assert.equal(e.code, code, ctx);
}

export const sleep = (ms) => new Promise((r) => setTimeout(r, ms));
