// Live parts of a dashboard page: every element with data-live="URL" is fetched again
// every data-every seconds and replaced by the server's rendering (already escaped there;
// the Content-Security-Policy runs no script that came with it). No library, no build step.
// A 401 means the session ended (logout, expiry, a restart of the dashboard): the page
// stops refreshing and says so, with a link to the login that comes back here.
"use strict";
(function () {
  let stopped = false;

  function loggedOut() {
    if (stopped) return;
    stopped = true;
    document.body.classList.add("logged-out");
    const notice = document.createElement("p");
    notice.id = "logged-out";
    notice.className = "bad";
    notice.append("Not logged in any more (the session ended): this page stopped updating. ");
    const link = document.createElement("a");
    link.href = "/login?next=" + encodeURIComponent(location.pathname + location.search);
    link.textContent = "Log in again";
    notice.append(link);
    const main = document.querySelector("main") || document.body;
    main.prepend(notice);
  }

  function watch(element) {
    const every = 1000 * (Number(element.dataset.every) || 5);
    async function refresh() {
      if (stopped) return;
      try {
        const answer = await fetch(element.dataset.live,
                                   {credentials: "same-origin", redirect: "error"});
        if (answer.status === 401) {
          loggedOut();
          return;
        }
        if (!answer.ok) throw new Error("HTTP " + answer.status);
        // A <details> the reader opened (a long error's whole text) stays open.
        const open = [...element.querySelectorAll("details")].map((d) => d.open);
        element.innerHTML = await answer.text();
        element.querySelectorAll("details").forEach((d, i) => { if (open[i]) d.open = true; });
        element.dataset.refreshed = String(Date.now());
        element.dispatchEvent(new CustomEvent("live:updated", {bubbles: true}));
        document.body.classList.remove("offline");
      } catch (error) {
        document.body.classList.add("offline");  // the dashboard itself is unreachable
      }
      setTimeout(refresh, every);
    }
    setTimeout(refresh, every);
  }
  document.querySelectorAll("[data-live]").forEach(watch);
})();
