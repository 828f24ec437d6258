// Copy buttons on commands and diffs. Nothing else needs script: charts are inline SVG.
(function () {
  function copyText(text, button) {
    function done() { button.textContent = "copied"; setTimeout(function () { button.textContent = "copy"; }, 1200); }
    if (navigator.clipboard && window.isSecureContext) {
      navigator.clipboard.writeText(text).then(done, function () { fallback(text); done(); });
    } else { fallback(text); done(); }
  }
  function fallback(text) {
    var area = document.createElement("textarea");
    area.value = text;
    document.body.appendChild(area);
    area.select();
    try { document.execCommand("copy"); } catch (e) { /* the text stays selectable */ }
    document.body.removeChild(area);
  }
  document.querySelectorAll(".copyable").forEach(function (box) {
    var pre = box.querySelector("pre");
    var button = document.createElement("button");
    button.className = "copy";
    button.type = "button";
    button.textContent = "copy";
    button.addEventListener("click", function () { copyText(pre.dataset.copy || pre.innerText, button); });
    box.appendChild(button);
  });
  // the step chart's x axis: wall time (start-up and gaps visible) or one bar per step
  document.querySelectorAll(".view-switch button").forEach(function (button) {
    button.addEventListener("click", function () {
      var section = button.closest("section");
      section.querySelectorAll(".view-switch button").forEach(function (b) {
        b.classList.toggle("on", b === button);
      });
      section.querySelectorAll(".step-views > div").forEach(function (view) {
        view.hidden = view.dataset.view !== button.dataset.view;
      });
    });
  });
  // icicle graphs: a click on a frame widens it to the full width (its callees with it); a
  // click on the top row ("all samples") goes back
  document.querySelectorAll("svg.icicle").forEach(function (svg) {
    var inner = parseFloat(svg.dataset.inner);
    var frames = Array.prototype.slice.call(svg.querySelectorAll("g.frame"));
    function zoom(a, w, depth) {
      frames.forEach(function (g) {
        var x = parseFloat(g.dataset.x), gw = parseFloat(g.dataset.w), d = parseInt(g.dataset.d, 10);
        var inside = x >= a - 1e-6 && x + gw <= a + w + 1e-6;
        var above = d < depth && x <= a + 1e-6 && x + gw >= a + w - 1e-6;
        g.style.display = inside || above ? "" : "none";
        if (!(inside || above)) { return; }
        var nx = above ? 0 : (x - a) / w * inner, nw = above ? inner : gw / w * inner;
        var rect = g.querySelector("rect"), text = g.querySelector("text");
        rect.setAttribute("x", nx + 1);
        rect.setAttribute("width", Math.max(nw - 1, 0.5));
        text.setAttribute("x", nx + 3);
        var chars = Math.floor((nw - 6) / 6.6), name = g.dataset.name;
        text.textContent = chars < 3 ? "" : (name.length <= chars ? name : name.slice(0, chars - 1) + "\u2026");
      });
    }
    frames.forEach(function (g) {
      g.addEventListener("click", function () {
        zoom(parseFloat(g.dataset.x), parseFloat(g.dataset.w), parseInt(g.dataset.d, 10));
      });
    });
  });
  document.documentElement.dataset.ready = "1";
})();
