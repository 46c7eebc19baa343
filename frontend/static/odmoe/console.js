// The admin console: renders the snapshot the console websocket sends (no reload), and acts through
// the REST API with the session's CSRF token. Server side: platform/controlplane/console/.
(function () {
  "use strict";
  const $ = (id) => document.getElementById(id);
  const errorLine = $("console-error");
  let state = { nodes: [], models: [], deployments: [], transfers: [], pauses: [] };
  const expertCodecs = JSON.parse($("expert-codecs").textContent);  // {choices, default}
  const buildChoices = {};  // model id -> {workers, codec}: each model's "Build shards" form

  function csrf() {
    const match = document.cookie.match(/(?:^|; )csrftoken=([^;]+)/);
    return match ? decodeURIComponent(match[1]) : "";
  }

  async function api(method, path, body) {
    const response = await fetch(path, {
      method,
      headers: { "Content-Type": "application/json", "X-CSRFToken": csrf() },
      body: body === undefined ? undefined : JSON.stringify(body),
    });
    const data = response.status === 204 ? null : await response.json();
    if (!response.ok) {
      const message = data && (data.detail || JSON.stringify(data));
      errorLine.textContent = `${method} ${path}: ${message}`;
      throw new Error(message);
    }
    errorLine.textContent = "";
    return data;
  }

  const el = (tag, attrs, ...children) => {
    const node = document.createElement(tag);
    Object.entries(attrs || {}).forEach(([k, v]) => {
      if (k === "class") node.className = v; else if (k.startsWith("on")) node.addEventListener(k.slice(2), v); else node.setAttribute(k, v);
    });
    children.flat().forEach((c) => node.append(c instanceof Node ? c : document.createTextNode(String(c ?? ""))));
    return node;
  };
  const badge = (text) => el("span", { class: `badge ${text}` }, text);
  const gib = (bytes) => (!bytes ? "–" : bytes >= 2 ** 30 ? `${(bytes / 2 ** 30).toFixed(1)} GiB` : `${(bytes / 2 ** 20).toFixed(1)} MiB`);
  const size = (bytes) => (bytes >= 1e9 ? `${(bytes / 1e9).toFixed(1)} GB` : `${Math.round(bytes / 1e6)} MB`);
  // A running role's memory as its agent last reported it: host RAM now / at peak, and GPU memory.
  const roleMemory = (memory) => (memory && memory.host_bytes !== undefined
    ? el("span", { class: "memory muted", title: "host RAM now / peak · GPU memory" },
      ` RAM ${size(memory.host_bytes)} / peak ${size(memory.peak_host_bytes || 0)} · GPU ${size(memory.device_bytes || 0)}`)
    : "");
  const ago = (iso) => (iso ? `${Math.max(0, Math.round((Date.now() - Date.parse(iso)) / 1000))} s ago` : "never");

  function roleOf(nodeId) {
    for (const d of state.deployments) {
      if (!["deploying", "ready", "degraded"].includes(d.status)) continue;
      const m = d.members.find((x) => x.node === nodeId);
      if (m) return { deployment: d, member: m };
    }
    return null;
  }

  function transferOf(nodeName) {
    return state.transfers.find((t) => t.node_name === nodeName && !t.finished && t.total > 0);
  }

  // What the node's doctor found (failures keep it out of every role), under its name.
  function problemsOf(n) {
    return [...n.problems.map((p) => el("div", { class: "error", "data-problem": "" }, p)),
      ...n.warnings.map((w) => el("div", { class: "muted" }, w))];
  }

  // The agent's version against the server's, with the one-line upgrade where they differ.
  function agentOf(n) {
    if (!n.agent_version) return el("span", { class: "muted" }, "unknown");
    if (n.agent_version === state.server_version) return n.agent_version;
    const upgrade = JSON.parse($("upgrade-command").textContent);  // with the server's pin, if it has one
    return el("span", { "data-upgrade": "" }, `${n.agent_version} (server ${state.server_version}): upgrade with `,
      el("code", {}, upgrade));
  }

  function renderNodes() {
    $("node-rows").replaceChildren(...state.nodes.map((n) => {
      const seat = roleOf(n.id);
      const transfer = transferOf(n.name);
      const activity = transfer
        ? el("span", {}, `fetching ${transfer.role} `, el("progress", { max: transfer.total, value: transfer.done }))
        : seat ? `${seat.member.state} (${seat.deployment.name})` : "idle";
      const gpus = n.gpus.length ? n.gpus.map((g) => `${g.name} ${gib(g.memory_bytes)}`).join(", ") : "none";
      // When the agent's link last came up: a reconnection (a control-plane restart, a network blip) shows here.
      const link = n.status !== "offline" && n.connected_at
        ? el("span", { class: "muted", title: "when its agent's link last came up" }, ` connected ${ago(n.connected_at)}`) : "";
      return el("tr", { "data-node": n.name },
        el("td", {}, n.name, ...problemsOf(n)), el("td", {}, badge(n.status), link), el("td", {}, seat ? seat.member.role : "–"),
        el("td", {}, agentOf(n)),
        el("td", {}, gpus), el("td", {}, `${n.cpu_count ?? "?"} cores / ${gib(n.ram_bytes)}`),
        el("td", {}, ago(n.last_seen)), el("td", {}, activity),
        el("td", {}, el("button", { onclick: () => api("POST", `/api/nodes/${n.id}/drain`, { drain: n.status !== "draining" }) },
          n.status === "draining" ? "Undrain" : "Drain"),
          n.status === "offline" || n.status === "enrolled" ? "" :
            el("button", { title: "give the agent a new node credential; the old one stops working",
              onclick: () => api("POST", `/api/nodes/${n.id}/rotate-credential`) }, "Rotate credential")));
    }));
    const chosen = new Set([...document.querySelectorAll("#node-choices input:checked")].map((i) => i.value));
    $("node-choices").replaceChildren(...state.nodes.filter((n) => n.status === "online").map((n) =>
      el("label", { class: "inline" }, el("input", Object.assign({ type: "checkbox", value: n.id, name: "nodes" },
        chosen.has(n.id) ? { checked: "" } : {})), ` ${n.name} `)));
  }

  function renderModels() {
    $("model-rows").replaceChildren(...state.models.map((m) => {
      const s = m.summary || {};
      const shards = m.shard_status === "building"
        ? el("span", {}, badge("building"), " ", el("progress", { max: 1, value: m.shard_progress }))
        : el("span", {}, badge(m.shard_status), m.shard_workers ? ` for ${m.shard_workers} workers${m.shard_expert_codec && m.shard_expert_codec !== "none" ? `, experts coded ${m.shard_expert_codec}` : ""}` : "", m.shard_error ? ` ${m.shard_error}` : "");
      // What the user changed in this row's build form, kept across snapshots (each one redraws the
      // rows); what they did not change follows the model (its last build's workers, the declared default codec).
      const chosen = buildChoices[m.id] || (buildChoices[m.id] = {});
      const workers = el("input", { type: "number", min: 1, value: chosen.workers ?? (m.shard_workers || 8), style: "width:4rem",
        oninput: () => { chosen.workers = workers.value; } });
      // The expert codec's declared choices and default (inference/settings.py), as the API's field has them.
      const picked = chosen.codec ?? expertCodecs.default;
      const codec = el("select", { name: "expert_codec", onchange: () => { chosen.codec = codec.value; } },
        ...expertCodecs.choices.map((c) => el("option", c === picked ? { selected: "" } : {}, c)));
      // A model registered by Hub repo id is listed while it downloads, and with its reason if that failed.
      const shape = m.status === "downloading"
        ? el("span", {}, badge("downloading"), ` ${m.repo_id} `, el("progress", { max: 1, value: m.download_progress }))
        : m.status === "failed"
          ? el("span", {}, badge("failed"), ` ${m.error}`)
          : `${s.family ? s.family + ", " : ""}${s.layers} layers, ${s.experts} experts, top-${s.top_k}`;
      return el("tr", {}, el("td", {}, m.name), el("td", {}, shape),
        el("td", {}, gib(m.total_bytes)), el("td", {}, m.status === "ready" ? shards : "–"),
        el("td", {}, workers, codec, el("button", { onclick: () => api("POST", `/api/models/${m.id}/shards`,
          { workers: Number(workers.value), expert_codec: codec.value }) }, "Build shards")));
    }));
    const select = $("model-select");
    const keep = select.value;
    select.replaceChildren(...state.models.map((m) => el("option", { value: m.id }, m.name)));
    if (keep) select.value = keep;
  }

  function renderDeployments() {
    $("deployment-list").replaceChildren(...state.deployments.map((d) => {
      const running = ["deploying", "ready", "degraded"].includes(d.status);
      const token = el("input", { type: "number", min: 0, value: d.token_period, style: "width:4rem" });
      const kv = el("input", { type: "number", min: 0, value: d.kv_period, style: "width:4rem" });
      const members = d.members.map((m) => {
        const transfer = state.transfers.find((t) => t.node_name === m.node_name && t.deployment === d.id && !t.finished);
        return el("li", { "data-role": m.role }, `${m.role} on ${m.node_name}${m.gpu === null || m.gpu === undefined ? "" : ` cuda:${m.gpu}`} `, badge(m.state), roleMemory(m.memory),
          transfer && transfer.total ? el("progress", { max: transfer.total, value: transfer.done }) : "",
          m.detail ? el("span", { class: "muted" }, ` ${m.detail.split("\n")[0]}`) : "");
      });
      return el("div", { class: "deployment", "data-deployment": d.name },
        el("h3", {}, `${d.name} `, badge(d.status), el("span", { class: "muted" }, ` ${d.strategy}${d.approximate ? " (approximate: not Transformers' tokens)" : ""}${d.predictor ? ` with ${d.predictor}` : ""} · max batch ${d.max_batch} · max per user ${d.max_per_user}${d.expert_codec && d.expert_codec !== "none" ? ` · experts coded ${d.expert_codec}` : ""}${d.draft_tokens ? ` · drafts ${d.draft_policy === "auto" ? "up to " : ""}${d.draft_tokens}` : ""} · ${d.status_reason}`)),
        el("div", { class: "row" },
          running ? el("button", { onclick: () => api("POST", `/api/deployments/${d.id}/stop`) }, "Stop")
                  : el("button", { onclick: () => api("POST", `/api/deployments/${d.id}/start`) }, "Start"),
          el("label", {}, "Token period", token), el("label", {}, "KV period", kv),
          el("button", { onclick: () => api("PATCH", `/api/deployments/${d.id}/settings`, { token_period: Number(token.value), kv_period: Number(kv.value) }) }, "Apply")),
        el("ul", { class: "members" }, members));
    }));
  }

  function shownDeployment() {
    return state.deployments.find((x) => x.status === "ready" || x.status === "degraded");
  }

  function renderCluster() {
    const d = shownDeployment();
    const main = d && d.members.find((m) => m.role === "main");
    const m = main ? main.metrics : null;
    if (!d || !m || m.decode_tok_s == null) {
      $("cluster-view").replaceChildren(el("p", { class: "muted" }, d ? `${d.name}: no generation yet.` : "No deployment is ready."));
      return;
    }
    const groups = (m.groups || []).map((g, i) => `group ${i}: workers ${g.join(", ")}`).join(" · ");
    $("cluster-view").replaceChildren(
      el("p", {}, `${d.name} — last generation: ${m.generated_tokens} tokens, TTFT ${Math.round(m.ttft_ms)} ms, `,
        `decode ${m.decode_tok_s.toFixed(1)} tok/s, recall ${m.recall == null ? "n/a" : (m.recall * 100).toFixed(1) + "%"}, `,
        `predictions in time ${m.prediction_in_time == null ? "n/a" : Math.round(m.prediction_in_time * 100) + "%"}, `,
        `coordination ${m.decode_layer_coordination_ms_median == null ? "n/a" : m.decode_layer_coordination_ms_median.toFixed(2) + " ms"}/layer`),
      ...(m.drafts && m.drafts.passes ? [el("p", {}, `drafts: ${Math.round(m.drafts.agreement * 100)}% kept, `,
        `${m.drafts.tokens_per_pass.toFixed(2)} tokens per decode pass, `,
        `${m.drafts.distinct_experts.toFixed(2)} distinct experts per layer per pass`)] : []),
      el("p", { class: "muted" }, groups));
  }

  // Live steps: one message per generated token, from the agent of main (see agent/runtime.py).
  const steps = [];
  let drawPending = false;

  function onStep(message) {
    const d = shownDeployment();
    if (!d || message.deployment !== d.runtime_key) return;
    steps.push(message);
    if (steps.length > 200) steps.shift();
    if (!drawPending) { drawPending = true; requestAnimationFrame(drawSteps); }
  }

  function drawSteps() {
    drawPending = false;
    const last = steps[steps.length - 1];
    if (!last) return;
    const step = last.step;
    $("live-step").textContent = `request ${last.request_id.slice(0, 8)}, token ${last.index + 1}, step ${step.step}` +
      (step.ms ? ` (${step.ms.toFixed(1)} ms)` : "") +
      `, batch of ${step.batch ?? 1} sequence${(step.batch ?? 1) === 1 ? "" : "s"} active` +
      (step.drafted ? `, a pass of ${step.drafted + 1} positions: ${step.accepted} of ${step.drafted} drafts kept` : "");
    $("pipeline-rows").replaceChildren(...step.layers.map((l) => {
      const predicted = l.predicted === undefined ? "prefill" : l.predicted === null ? "none in time" : l.predicted.join(", ");
      const computing = Math.max(0, l.worker_ms - l.wait_ms);
      return el("tr", { "data-layer": l.layer },
        el("td", {}, l.layer), el("td", {}, l.group === null ? "all (prefill)" : `group ${l.group}`),
        el("td", {}, l.real.join(", ")),
        el("td", { class: l.recall !== undefined && l.recall < 1 ? "miss" : "" }, predicted),
        el("td", {}, l.recall === undefined ? "–" : `${Math.round(l.recall * 100)}%`),
        el("td", {}, el("span", { class: "phase loading", style: `width:${Math.min(120, l.wait_ms * 20)}px` }), ` ${l.wait_ms.toFixed(2)}`),
        el("td", {}, el("span", { class: "phase computing", style: `width:${Math.min(120, computing * 20)}px` }), ` ${computing.toFixed(2)}`),
        el("td", {}, l.dispatch_ms.toFixed(2)));
    }));
    // A drafted pass's tokens share its step: each pass once, with the tokens it yielded.
    const decode = steps.filter((s, i) => s.step.step > 0 && s.step.ms &&
      !(i > 0 && steps[i - 1].request_id === s.request_id && steps[i - 1].step.step === s.step.step));
    chart("toks-chart", decode.map((s) => 1000 * ((s.step.accepted ?? 0) + 1) / s.step.ms), "#2f6feb");
    chart("recall-chart", decode.map((s) => s.step.recall ?? 0), "#16a34a", 1);
  }

  function chart(id, values, color, fixedTop) {
    const canvas = $(id);
    const ctx = canvas.getContext("2d");
    ctx.clearRect(0, 0, canvas.width, canvas.height);
    if (!values.length) return;
    const top = fixedTop || Math.max(...values) * 1.2 || 1;
    ctx.strokeStyle = color;
    ctx.beginPath();
    values.slice(-120).forEach((v, i, all) => {
      const x = (i / Math.max(1, all.length - 1)) * (canvas.width - 20) + 10;
      const y = canvas.height - 10 - (v / top) * (canvas.height - 25);
      if (i === 0) ctx.moveTo(x, y); else ctx.lineTo(x, y);
    });
    ctx.stroke();
    ctx.fillStyle = "#6b7280";
    ctx.fillText(`last ${values[values.length - 1].toFixed(2)} · max ${Math.max(...values).toFixed(2)}`, 10, 12);
  }

  function renderPauses() {
    const rows = state.pauses.map((p) => el("tr", { "data-cause": p.cause },
      el("td", {}, new Date(p.at).toLocaleString()), el("td", {}, p.deployment || "(deleted)"),
      el("td", {}, p.cause_label), el("td", {}, p.at_token == null ? "?" : String(p.at_token)),
      el("td", {}, p.paused_ms == null ? "?" : String(Math.round(p.paused_ms))),
      el("td", {}, p.detail), el("td", { class: "muted" }, p.request_id)));
    $("pause-rows").replaceChildren(...(rows.length ? rows
      : [el("tr", {}, el("td", { colspan: 7, class: "muted" }, "No answer has paused."))]));
  }

  function render() { renderNodes(); renderModels(); renderDeployments(); renderCluster(); renderPauses(); }

  $("token-form").addEventListener("submit", async (event) => {
    event.preventDefault();
    const form = new FormData(event.target);
    const token = await api("POST", "/api/join-tokens", { name: form.get("name"), max_uses: Number(form.get("max_uses")) });
    $("install-command").textContent = token.install_command;
    $("agent-command").textContent = token.agent_command;
    // Reached over plain http off loopback: agents refuse this server without --insecure.
    $("token-warning").textContent = token.warning;
    $("token-warning").hidden = !token.warning;
    $("token-result").hidden = false;
  });
  $("model-form").addEventListener("submit", async (event) => {
    event.preventDefault();
    const form = new FormData(event.target);
    await api("POST", "/api/models", { name: form.get("name"), path: form.get("path") });
    event.target.reset();
  });
  function deploymentBody() {
    const form = new FormData($("deployment-form"));
    return {
      name: form.get("name"), model: Number(form.get("model")), nodes: form.getAll("nodes"),
      shadow_dtype: form.get("shadow_dtype"), token_period: Number(form.get("token_period")), kv_period: Number(form.get("kv_period")),
      strategy: form.get("strategy"), predictor: form.get("predictor"), max_batch: Number(form.get("max_batch")),
      max_per_user: Number(form.get("max_per_user")), expert_codec: form.get("expert_codec"),
      draft_tokens: Number(form.get("draft_tokens")), draft_policy: form.get("draft_policy"),
      replay: form.get("replay"),
    };
  }
  // A shadow seat only where the predictor is the shadow: the chosen one, else the strategy's own.
  const ownPredictors = JSON.parse($("own-predictors").textContent);
  const hasShadow = (body) => (body.predictor || ownPredictors[body.strategy]) === "shadow";
  const gb = (bytes) => `${(bytes / 1e9).toFixed(1)} GB`;
  api("GET", "/api/deployments/estimate").then((found) => {
    $("profile-select").replaceChildren(...found.profiles.map((p) => el("option", { value: p.name, title: p.description }, p.name)));
    $("profile-select").value = found.default;
  });
  $("estimate").addEventListener("click", async () => {
    const body = deploymentBody();
    // A node with several GPUs runs a role on each (see the role map): count seats, not nodes.
    const seats = body.nodes.reduce((n, id) => {
      const gpus = ((state.nodes.find((x) => x.id === id) || {}).gpus || []).length;
      return n + (gpus > 1 ? gpus : 1);
    }, 0);
    const withShadow = hasShadow(body);
    const workers = Math.max(1, seats - (withShadow ? 2 : 1));
    const shadow = ["fp16", "int8", "nf4"].includes(body.shadow_dtype) ? body.shadow_dtype : "int8";
    const result = await api("POST", "/api/deployments/estimate", {
      model: body.model || undefined, workers, strategy: body.strategy, predictor: body.predictor, shadow_dtype: shadow,
      profile: new FormData($("deployment-form")).get("profile"), max_batch: body.max_batch,
      expert_codec: body.expert_codec,  // a coded plan is refused with the reason, not estimated as uncoded
      draft_tokens: body.draft_tokens,  // so are drafts: the simulator does not model them yet
    });
    const line = (kind) => `${kind}: ${result[kind].decode_tok_s.toFixed(2)} tok/s decode, TTFT ${result[kind].ttft_ms.toFixed(0)} ms`;
    const perWorker = result.adjusted.memory_bytes.worker0;
    // Memory per role from the checkpoint's tensor sizes (inference/memory.py): what creating checks each node against.
    const roles = result.memory.roles;
    const size = (bytes) => (bytes >= 1e9 ? gb(bytes) : `${(bytes / 1e6).toFixed(1)} MB`);
    const range = (key) => {
      const values = roles.filter((r) => r.role.startsWith("worker-")).map((r) => r[key]);
      const low = Math.min(...values), high = Math.max(...values);
      return low === high ? size(low) : `${size(low)}–${size(high)}`;
    };
    const cells = (r) => [r.host_bytes, r.gpu_bytes, r.disk_bytes].map((b) => el("td", {}, size(b)));
    const memoryTable = el("table", { id: "estimate-memory" },
      el("thead", {}, el("tr", {}, ...["Role", "RAM", "GPU", "Disk"].map((h) => el("th", {}, h)))),
      el("tbody", {},
        el("tr", {}, el("td", {}, "main"), ...cells(roles.find((r) => r.role === "main"))),
        withShadow ? el("tr", {}, el("td", {}, `shadow (${shadow})`), ...cells(roles.find((r) => r.role === "shadow"))) : "",
        el("tr", {}, el("td", {}, `each worker (${workers})`), ...["host_bytes", "gpu_bytes", "disk_bytes"].map((k) => el("td", {}, range(k))))));
    $("estimate-result").replaceChildren(el("p", { id: "estimate-line" },
      `Simulated on ${result.profile.name} with ${workers} workers (${result.strategy}, ${withShadow ? `${shadow} shadow` : `no shadow: ${result.predictor || "no"} predictor`}): ${line("adjusted")} `
      + `(roofline ${result.ideal.decode_tok_s.toFixed(2)} tok/s); memory: ${perWorker ? gb(perWorker) + " per worker, " : ""}`
      + `${gb(result.adjusted.memory_total_bytes)} in all. See README, "Cluster simulator", for what it assumes.`),
      el("p", {}, "Memory per role, from the checkpoint's tensor sizes" + (result.memory.kv_cache ? `, with ${result.memory.kv_cache}` : "")
        + " (creating a deployment checks each node against it):"), memoryTable);
  });
  let suggested = null;
  $("suggest").addEventListener("click", async () => {
    const body = deploymentBody();
    suggested = await api("POST", "/api/deployments/suggest", {
      model: body.model, nodes: body.nodes, shadow_dtype: body.shadow_dtype, strategy: body.strategy, predictor: body.predictor,
      max_batch: body.max_batch, expert_codec: body.expert_codec,
    });
    const name = (seat) => {  // a node id, or <node id>:<GPU index> on a box that runs a role per GPU
      const [id, gpu] = seat.split(":");
      const node = (state.nodes.find((n) => n.id === id) || { name: id }).name;
      return gpu === undefined ? node : `${node} cuda:${gpu}`;
    };
    const shadowSeat = suggested.shadow ? ` · shadow: ${name(suggested.shadow)}` : " · no shadow";
    $("role-map").replaceChildren(el("p", {}, `main: ${name(suggested.main)}${shadowSeat} · workers: ${suggested.workers.map(name).join(", ")}`));
    $("create-deployment").disabled = false;
  });
  $("deployment-form").addEventListener("submit", async (event) => {
    event.preventDefault();
    const created = await api("POST", "/api/deployments", Object.assign(deploymentBody(), suggested ? { roles: suggested } : {}));
    await api("POST", `/api/deployments/${created.id}/start`);
    $("create-deployment").disabled = true;
    $("role-map").replaceChildren();
    suggested = null;
  });

  function connect() {
    const scheme = location.protocol === "https:" ? "wss" : "ws";
    const socket = new WebSocket(`${scheme}://${location.host}/ws/console/`);
    socket.addEventListener("open", () => { $("live").textContent = "live"; });
    socket.addEventListener("message", (event) => {
      const message = JSON.parse(event.data);
      if (message.type === "snapshot") { state = message; render(); }
      else if (message.type === "step") onStep(message);
    });
    socket.addEventListener("close", () => { $("live").textContent = "reconnecting…"; setTimeout(connect, 1000); });
  }
  connect();
})();
