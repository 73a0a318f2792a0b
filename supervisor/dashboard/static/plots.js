// The value under the pointer on a chart (svg.chart, drawn on the server): its samples are
// numbers in data- attributes (data-ages: seconds before data-end; data-values), read
// here; nothing else of the page is. A live update (live.js) swaps the chart for a new one:
// the readout follows to the new chart while the pointer stays. No library, no build step.
"use strict";
(function () {
  let pointed = null;  // {key, fraction}: the chart (data-key) and where on it, 0..1

  function samples(svg) {
    const ages = svg.dataset.ages ? svg.dataset.ages.split(" ").map(Number) : [];
    const values = svg.dataset.values ? svg.dataset.values.split(" ").map(Number) : [];
    return ages.map((age, i) => ({age: age, value: values[i]}));
  }

  function nearest(svg, fraction) {
    const wanted = Number(svg.dataset.span) * (1 - fraction);  // seconds before the end
    let best = null;
    for (const sample of samples(svg)) {
      if (best === null || Math.abs(sample.age - wanted) < Math.abs(best.age - wanted)) {
        best = sample;
      }
    }
    return best;
  }

  function describe(svg, sample) {
    const rate = svg.dataset.what === "jobs/s";
    const value = rate ? sample.value.toLocaleString("en-US", {maximumFractionDigits: 2})
                       : Math.round(sample.value).toLocaleString("en-US");
    const at = new Date((Number(svg.dataset.end) - sample.age) * 1000);
    const ago = sample.age < 120 ? Math.round(sample.age) + " s"
                                 : Math.round(sample.age / 60) + " min";
    return value + " " + svg.dataset.what + " at " + at.toISOString().slice(11, 19) +
      " UTC (" + ago + " ago)";
  }

  function show(svg, fraction) {
    const plot = svg.closest(".plot");
    const readout = plot.querySelector(".readout");
    const sample = nearest(svg, fraction);
    if (!sample) {
      readout.textContent = "no sample yet";
    } else {
      readout.textContent = describe(svg, sample);
      mark(svg, sample);
    }
    plot.classList.add("pointing");
    const box = svg.getBoundingClientRect(), outer = plot.getBoundingClientRect();
    const left = box.left - outer.left + fraction * box.width - readout.offsetWidth / 2;
    readout.style.left = Math.max(0, Math.min(left, outer.width - readout.offsetWidth)) + "px";
  }

  function mark(svg, sample) {
    // Where the sample is drawn, in the chart's own units (as plots.py places it).
    const [, , width, height] = svg.getAttribute("viewBox").split(" ").map(Number);
    const x = width * (1 - sample.age / Number(svg.dataset.span));
    const y = height - 2 - (height - 4) * sample.value / Number(svg.dataset.top);
    for (const line of svg.querySelectorAll(".cursor, .dot")) {
      line.setAttribute("x1", x);
      line.setAttribute("x2", x);
    }
    const dot = svg.querySelector(".dot");
    dot.setAttribute("y1", y);
    dot.setAttribute("y2", y);
  }

  function hide() {
    for (const plot of document.querySelectorAll(".plot.pointing")) {
      plot.classList.remove("pointing");
      plot.querySelector(".readout").textContent = "";
    }
  }

  function point(event) {
    const svg = event.target.closest && event.target.closest("svg.chart");
    if (!svg) {
      if (pointed) { pointed = null; hide(); }
      return;
    }
    const box = svg.getBoundingClientRect();
    const fraction = Math.max(0, Math.min(1, (event.clientX - box.left) / box.width));
    if (pointed && pointed.key !== svg.dataset.key) hide();
    pointed = {key: svg.dataset.key, fraction: fraction, by: "pointer"};
    show(svg, fraction);
  }

  function focus(event) {  // a keyboard's way in: the newest sample
    const svg = event.target.closest && event.target.closest("svg.chart");
    if (svg && !(pointed && pointed.by === "pointer")) {
      hide();
      pointed = {key: svg.dataset.key, fraction: 1, by: "focus"};
      show(svg, 1);
    }
  }

  function blur(event) {  // not when a live update swapped the focused chart away
    if (pointed && pointed.by === "focus" && event.target.isConnected) {
      pointed = null;
      hide();
    }
  }

  document.addEventListener("pointermove", point);
  document.addEventListener("pointerdown", point);
  document.documentElement.addEventListener("pointerleave", () => { pointed = null; hide(); });
  document.addEventListener("focusin", focus);
  document.addEventListener("focusout", blur);
  document.addEventListener("live:updated", () => {
    if (!pointed) return;
    const svg = [...document.querySelectorAll("svg.chart")]
      .find((chart) => chart.dataset.key === pointed.key);
    if (svg) show(svg, pointed.fraction);
  });
})();
