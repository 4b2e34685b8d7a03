"use strict";
(function () {
  const KEY = "retrysafe-admin-token";
  async function open(token) {
    const r = await fetch(location.href, { headers: { Authorization: "Bearer " + token }, cache: "no-store" });
    if (!r.ok) return false;
    sessionStorage.setItem(KEY, token);
    const html = await r.text();
    document.open();
    document.write(html);
    document.close();
    return true;
  }
  const saved = sessionStorage.getItem(KEY);
  if (saved) open(saved).then((ok) => { if (!ok) sessionStorage.removeItem(KEY); });
  document.getElementById("login").addEventListener("submit", async (ev) => {
    ev.preventDefault();
    const ok = await open(document.getElementById("token").value);
    if (!ok) document.getElementById("login-error").hidden = false;
  });
})();
