"use strict";
(function () {
  // The token stays in this page's memory only: never in storage that other pages of
  // this origin (a proxied app behind the gateway) could read.
  async function open(token) {
    const r = await fetch(location.href, { headers: { Authorization: "Bearer " + token }, cache: "no-store" });
    if (!r.ok) return false;
    window.retrysafeAdminToken = token;
    if (r.redirected) history.replaceState(null, "", r.url);
    const type = r.headers.get("content-type") || "";
    const body = await r.text();
    if (!type.startsWith("text/html")) {
      // JSON or metrics text: shown as text, never parsed as a page.
      const pre = document.createElement("pre");
      pre.textContent = body;
      document.body.replaceChildren(pre);
      return true;
    }
    document.open();
    document.write(body);
    document.close();
    return true;
  }
  document.getElementById("login").addEventListener("submit", async (ev) => {
    ev.preventDefault();
    const ok = await open(document.getElementById("token").value);
    if (!ok) document.getElementById("login-error").hidden = false;
  });
})();
