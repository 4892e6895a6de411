// A client generated in a second language: Node's @grpc/grpc-js + @grpc/proto-loader load
// protos/inference/grpc_service.proto with the include root `protos` (its imports are
// `inference/model_config.proto`), then stream ModelStreamInfer against a real `kvmesh up`.
// Run: `make test-node` (node --test tests/node/); needs `make setup-dev` (.venv and node_modules).
import { test, before, after } from "node:test";
import assert from "node:assert/strict";
import { spawn } from "node:child_process";
import fs from "node:fs";
import net from "node:net";
import os from "node:os";
import path from "node:path";
import { fileURLToPath } from "node:url";
import grpc from "@grpc/grpc-js";
import protoLoader from "@grpc/proto-loader";

const ROOT = path.resolve(path.dirname(fileURLToPath(import.meta.url)), "../..");
const MODEL = "kvmesh-mock";
let up;
let port;
let tmp;

function freePort() {
  return new Promise((resolve, reject) => {
    const server = net.createServer();
    server.on("error", reject);
    server.listen(0, "127.0.0.1", () => {
      const { port: found } = server.address();
      server.close(() => resolve(found));
    });
  });
}

before(async () => {
  port = await freePort();
  tmp = fs.mkdtempSync(path.join(os.tmpdir(), "kvmesh-node-"));
  const args = ["up", "--grpc-port", String(port), "--discovery", `file://${tmp}/discovery`, "--namespace", "node",
    "--log-dir", `${tmp}/logs`, "--no-demo", "--speedup-ratio", "0"];
  up = spawn(path.join(ROOT, ".venv/bin/kvmesh"), args, { stdio: ["ignore", "pipe", "pipe"] });
  let seen = "";
  await new Promise((resolve, reject) => {
    const timer = setTimeout(() => reject(new Error(`kvmesh up not up in 60 s:\n${seen}`)), 60_000);
    up.stdout.on("data", (chunk) => {
      seen += chunk;
      if (seen.includes("kvmesh is up")) { clearTimeout(timer); resolve(); }
    });
    up.stderr.on("data", (chunk) => { seen += chunk; });
    up.on("exit", (code) => { clearTimeout(timer); reject(new Error(`kvmesh up exited ${code}:\n${seen}`)); });
  });
});

after(async () => {
  if (up && up.exitCode === null) {
    up.removeAllListeners("exit");
    const exited = new Promise((resolve) => up.on("exit", resolve));
    up.kill("SIGTERM");
    await exited;
  }
  fs.rmSync(tmp, { recursive: true, force: true });
});

function bytesInput(name, text) {
  return { name, datatype: "BYTES", shape: [1], contents: { bytes_contents: [Buffer.from(text)] } };
}

function boolInput(name, value) {
  return { name, datatype: "BOOL", shape: [1], contents: { bool_contents: [value] } };
}

// Raw BYTES: each element is a 4-byte little-endian length, then the bytes.
function rawBytes(buffer) {
  const values = [];
  for (let at = 0; at < buffer.length;) {
    const length = buffer.readUInt32LE(at);
    values.push(buffer.subarray(at + 4, at + 4 + length).toString());
    at += 4 + length;
  }
  return values;
}

test("ModelStreamInfer streams one request's tokens to a @grpc/grpc-js client", async () => {
  const definition = protoLoader.loadSync("inference/grpc_service.proto", {
    includeDirs: [path.join(ROOT, "protos")], keepCase: true, longs: String, defaults: true,
  });
  const { inference } = grpc.loadPackageDefinition(definition);
  const client = new inference.GRPCInferenceService(`127.0.0.1:${port}`, grpc.credentials.createInsecure());
  const call = client.ModelStreamInfer();
  const responses = [];
  const done = new Promise((resolve, reject) => {
    call.on("data", (message) => {
      if (message.error_message) { reject(new Error(message.error_message)); return; }
      responses.push(message.infer_response);
      if (message.infer_response.parameters.triton_final_response?.bool_param) { call.end(); }
    });
    call.on("error", reject);
    call.on("end", resolve);
  });
  call.write({
    model_name: MODEL, id: "node-1",
    inputs: [bytesInput("text_input", "Tell me about KV caches"), boolInput("stream", true),
      bytesInput("sampling_parameters", '{"max_tokens": 8, "ignore_eos": true}'),
      boolInput("return_num_output_tokens", true), boolInput("return_finish_reason", true)],
  });
  await done;
  client.close();

  assert.ok(responses.length >= 1);
  let tokens = 0;
  let text = "";
  for (const response of responses) {
    assert.equal(response.id, "node-1");
    const names = response.outputs.map((output) => output.name);
    const raw = Object.fromEntries(names.map((name, i) => [name, response.raw_output_contents[i]]));
    tokens += raw.num_output_tokens.readUInt32LE(0);
    text += rawBytes(raw.text_output).join("");
  }
  assert.equal(tokens, 8);
  assert.ok(text.length > 0);
  const last = responses.at(-1);
  const reason = rawBytes(last.raw_output_contents[last.outputs.findIndex((o) => o.name === "finish_reason")]);
  assert.deepEqual(reason, ["length"]);
});
