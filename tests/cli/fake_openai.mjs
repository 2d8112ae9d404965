// SPDX-License-Identifier: Apache-2.0
// A fake OpenAI-compatible streaming server for tests/cli/bench_serve.sh (node's
// built-in http module only). Listens on 127.0.0.1 at a free port and prints
// the port on stdout.
//
// Usage: node fake_openai.mjs MODE [BODY_LOG]
//   ok           every request streams max_tokens tokens, 1 to 3 a event (as under
//                speculation), then a usage event with usage.speculative, then [DONE]
//   429          every second request (by arrival) gets 429 with an OpenAI error body
//   error-event  every second request streams two events, then {"error": ...} and [DONE]
//   hang         reads the request, never answers
// A request body missing what bench-serve must send (stream, include_usage,
// ignore_eos, an integer max_tokens, prompt or messages) gets 400.
// BODY_LOG, when given, receives each request body as one line.
import http from 'node:http';
import fs from 'node:fs';

const mode = process.argv[2] ?? 'ok';
const bodyLog = process.argv[3];
let arrivals = 0;

function reject(res, status, message, type) {
  res.writeHead(status, {'Content-Type': 'application/json'});
  res.end(JSON.stringify({error: {message, type, param: null, code: null}}));
}

const server = http.createServer((req, res) => {
  let raw = '';
  req.on('data', (d) => { raw += d; });
  req.on('end', () => {
    const n = arrivals++;
    if (bodyLog) fs.appendFileSync(bodyLog, raw.replace(/\n/g, ' ') + '\n');
    if (mode === 'hang') return;  // never answers; the client must give up
    const chat = req.url === '/v1/chat/completions';
    if (req.method !== 'POST' || (!chat && req.url !== '/v1/completions'))
      return reject(res, 404, `no route ${req.method} ${req.url}`, 'not_found');
    let body;
    try { body = JSON.parse(raw); } catch { return reject(res, 400, 'not JSON', 'invalid_request_error'); }
    const ok = body.stream === true && body.stream_options?.include_usage === true &&
        body.ignore_eos === true && Number.isInteger(body.max_tokens) && body.max_tokens >= 1 &&
        (chat ? Array.isArray(body.messages) : typeof body.prompt === 'string');
    if (!ok) return reject(res, 400, `bad request body: ${raw.slice(0, 200)}`, 'invalid_request_error');
    if (mode === '429' && n % 2 === 1)
      return reject(res, 429, 'too many requests: the queue is full', 'rate_limit_error');

    // No Content-Length: node sends the stream with chunked transfer encoding.
    res.writeHead(200, {'Content-Type': 'text/event-stream', 'Cache-Control': 'no-cache'});
    const id = `cmpl-${n}`;
    const event = (obj) => res.write(`data: ${JSON.stringify(obj)}\n\n`);
    const content = (text) => event(chat
        ? {id, object: 'chat.completion.chunk', choices: [{index: 0, delta: {content: text}, finish_reason: null}]}
        : {id, object: 'text_completion', choices: [{index: 0, text, finish_reason: null}]});
    if (chat) event({id, object: 'chat.completion.chunk', choices: [{index: 0, delta: {role: 'assistant', content: ''}, finish_reason: null}]});
    let left = body.max_tokens, sent = 0, rounds = 0;
    const step = () => {
      if (mode === 'error-event' && n % 2 === 1 && sent >= 2) {
        event({error: {message: 'engine failure in the middle of the stream', type: 'server_error'}});
        res.end('data: [DONE]\n\n');
        return;
      }
      if (left > 0) {
        const k = Math.min(left, 1 + (rounds % 3));  // 1, 2, 3 tokens an event
        content(' tok'.repeat(k));
        left -= k; sent += 1; rounds += 1;
        setTimeout(step, 2);
        return;
      }
      event(chat
          ? {id, object: 'chat.completion.chunk', choices: [{index: 0, delta: {}, finish_reason: 'length'}]}
          : {id, object: 'text_completion', choices: [{index: 0, text: '', finish_reason: 'length'}]});
      event({id, choices: [], usage: {prompt_tokens: 10, completion_tokens: body.max_tokens,
        total_tokens: 10 + body.max_tokens,
        speculative: {drafted: 3 * rounds, accepted: body.max_tokens - rounds,
          accepted_by_position: [], tau: body.max_tokens / rounds}}});
      res.end('data: [DONE]\n\n');
    };
    setTimeout(step, 5);
  });
});
server.listen(0, '127.0.0.1', () => {
  process.stdout.write(`${server.address().port}\n`);
});
