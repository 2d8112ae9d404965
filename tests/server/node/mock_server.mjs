// SPDX-License-Identifier: Apache-2.0
// A stand-in for specula's server, for trying the chat page
// (server/web/index.html) and chat_page_test.mjs without a model:
//   node mock_server.mjs [port]        (default 8099; 0 picks a free port)
// It serves "/" from server/web/index.html (read on every request, so edits
// show on reload), GET /v1/models and a streaming POST /v1/chat/completions
// shaped like the real one (role event, content deltas, finish_reason, the
// usage event with usage.speculative, then [DONE]).
// A last user message containing "ERROR400" gets a 400 error body,
// "MIDERROR" an error event in the middle of the stream, "SLOW" slower tokens,
// "BURST" the whole stream in one write (nothing to see streaming).
import { createServer } from "node:http";
import { readFile } from "node:fs/promises";
import { fileURLToPath } from "node:url";
import path from "node:path";

const here = path.dirname(fileURLToPath(import.meta.url));
const pagePath = path.resolve(here, "../../../server/web/index.html");
const model = "gemma-4-mock";
const port = Number(process.argv[2] ?? process.env.PORT ?? 8099);

const sleep = (ms) => new Promise((r) => setTimeout(r, ms));

function json(res, status, body) {
  res.writeHead(status, { "Content-Type": "application/json" });
  res.end(JSON.stringify(body));
}

async function readBody(req) {
  const chunks = [];
  for await (const c of req) chunks.push(c);
  return Buffer.concat(chunks).toString("utf8");
}

function reply_for(text) {
  return `You said: "${text}". Here is a streamed reply from the mock server, ` +
         "one word at a time, so that the page shows it growing.\nSecond line.";
}

async function chat(req, res) {
  let body;
  try {
    body = JSON.parse(await readBody(req));
  } catch (e) {
    return json(res, 400, { error: { message: "body is not JSON: " + e.message,
                                     type: "invalid_request_error", param: null, code: null } });
  }
  if (!Array.isArray(body.messages) || body.messages.length === 0) {
    return json(res, 400, { error: { message: "messages: required", type: "invalid_request_error",
                                     param: "messages", code: null } });
  }
  const last = String(body.messages[body.messages.length - 1].content ?? "");
  console.log(`[mock] ${body.messages.length} messages, stream=${body.stream}, ` +
              `include_usage=${body.stream_options?.include_usage}, ` +
              `speculative=${JSON.stringify(body.speculative)}, last=${JSON.stringify(last)}`);
  if (last.includes("ERROR400")) {
    return json(res, 400, { error: { message: "mock: the request was refused (ERROR400)",
                                     type: "invalid_request_error", param: null, code: null } });
  }
  const id = "chatcmpl-mock" + Date.now();
  const created = Math.floor(Date.now() / 1000);
  const chunk = (choices, extra = {}) =>
    "data: " + JSON.stringify({ id, object: "chat.completion.chunk", created, model, choices, ...extra }) +
    "\n\n";
  const words = reply_for(last).split(/(?<= )/);
  const delay = last.includes("SLOW") ? 300 : 40;
  const speculative = body.speculative?.enabled !== false;

  if (!body.stream) {
    return json(res, 200, { id, object: "chat.completion", created, model,
                            choices: [{ index: 0, message: { role: "assistant", content: words.join("") },
                                        finish_reason: "stop" }],
                            usage: { prompt_tokens: 10, completion_tokens: words.length,
                                     total_tokens: 10 + words.length } });
  }
  res.writeHead(200, { "Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                       Connection: "keep-alive" });
  const out = [];  // BURST: collected, written at the end in one go
  const write = last.includes("BURST") ? (s) => out.push(s) : (s) => res.write(s);
  let aborted = false;
  res.on("close", () => { aborted = !res.writableEnded; });
  write(chunk([{ index: 0, delta: { role: "assistant", content: "" }, finish_reason: null }]));
  for (let i = 0; i < words.length; ++i) {
    if (!last.includes("BURST")) await sleep(delay);
    if (aborted) { console.log("[mock] client went away"); return; }
    if (last.includes("MIDERROR") && i === 5) {
      write("data: " + JSON.stringify({ error: { message: "mock: the engine failed mid-stream (MIDERROR)",
                                                      type: "server_error" } }) + "\n\n");
      res.end(out.join("") + "data: [DONE]\n\n");
      return;
    }
    write(chunk([{ index: 0, delta: { content: words[i] }, finish_reason: null }]));
  }
  write(chunk([{ index: 0, delta: {}, finish_reason: "stop" }]));
  if (body.stream_options?.include_usage) {
    const n = words.length;
    const usage = { prompt_tokens: 10, completion_tokens: n, total_tokens: 10 + n };
    if (speculative) {
      // Each verify round yields its accepted drafts plus one token.
      const k = body.speculative?.draft_tokens ?? 4;
      const rounds = Math.ceil(n / 2.5);
      const by = Array.from({ length: k }, (_, i) => Math.round(rounds * 0.75 ** (i + 1)));
      const accepted = by.reduce((a, b) => a + b, 0);
      usage.speculative = { drafted: rounds * k, accepted, accepted_by_position: by,
                            tau: (accepted + rounds) / rounds };
    }
    write(chunk([], { usage }));
  }
  res.end(out.join("") + "data: [DONE]\n\n");
}

const server = createServer(async (req, res) => {
  try {
    const url = new URL(req.url, "http://localhost");
    if (req.method === "GET" && url.pathname === "/") {
      res.writeHead(200, { "Content-Type": "text/html; charset=utf-8" });
      return res.end(await readFile(pagePath));
    }
    if (req.method === "GET" && url.pathname === "/v1/models") {
      return json(res, 200, { object: "list", data: [{ id: model, object: "model", created: 0,
                                                       owned_by: "specula" }] });
    }
    if (req.method === "POST" && url.pathname === "/v1/chat/completions") return await chat(req, res);
    json(res, 404, { error: { message: `no route for ${req.method} ${url.pathname}`, type: "not_found" } });
  } catch (e) {
    console.error(e);
    if (!res.headersSent) json(res, 500, { error: { message: String(e), type: "server_error" } });
    else res.end();
  }
});
server.listen(port, "127.0.0.1", () => {
  console.log(`mock server on http://127.0.0.1:${server.address().port}/`);
});
