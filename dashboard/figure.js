// One plotly figure of the dashboard, drawn by plotly.js in the page itself (dashboard/figures.py says why).
// data: {figure: the figure's JSON without its layout's shapes, shapes: those (JSON), config: plotly's config,
//        script: plotly.js's URL on this server, clickable: send a click on a point to Python (its x, y and trace as
//        the trigger value "click")}.

function plotlyLoaded(url) {
  // One <script> for the whole page, whatever the number of figures and reruns.
  if (!window.__policylensPlotly) {
    window.__policylensPlotly = new Promise((resolve, reject) => {
      const script = document.createElement("script");
      script.src = url;
      script.onload = () => resolve(window.Plotly);
      script.onerror = () => {
        window.__policylensPlotly = undefined; // the next figure tries again
        reject(new Error(`plotly.js was not found at ${url}`));
      };
      document.head.appendChild(script);
    });
  }
  return window.__policylensPlotly;
}

function rgba(colour, alpha) {
  // A theme colour (#rgb, #rrggbb or rgb(...)) with another opacity; grey when it is none of those.
  let rgb = null;
  const hex = /^#([0-9a-f]{3}|[0-9a-f]{6})$/i.exec(colour);
  if (hex) {
    const digits = hex[1].length === 3 ? [...hex[1]].map((d) => d + d) : hex[1].match(/../g);
    rgb = digits.map((d) => parseInt(d, 16));
  } else {
    const parts = /^rgba?\(([^)]*)\)$/.exec(colour);
    if (parts) rgb = parts[1].split(/[ ,/]+/).slice(0, 3).map(Number);
  }
  if (!rgb || rgb.some(Number.isNaN)) rgb = [128, 128, 128];
  return `rgba(${rgb.join(",")},${alpha})`;
}

function themeTemplate(element) {
  // The app's theme, as Streamlit gives it to components in CSS variables: {background, plotly: a template of its
  // text, fonts and chart colours}.
  const style = getComputedStyle(element);
  const value = (name) => style.getPropertyValue(`--st-${name}`).trim();
  const text = value("text-color") || "#31333f";
  const axis = { gridcolor: rgba(text, 0.1), linecolor: rgba(text, 0.2), zerolinecolor: rgba(text, 0.3),
                 tickcolor: rgba(text, 0.2), automargin: true };
  const categorical = value("chart-categorical-colors").split(",").map((c) => c.trim()).filter(Boolean);
  return { background: value("background-color") || "white", plotly: {
    layout: {
      font: { family: value("font") || "sans-serif", color: text },
      paper_bgcolor: "rgba(0,0,0,0)",
      plot_bgcolor: "rgba(0,0,0,0)",
      ...(categorical.length ? { colorway: categorical } : {}),
      xaxis: axis,
      yaxis: axis,
      hoverlabel: { bgcolor: value("secondary-background-color") || "#f0f2f6", font: { color: text } },
      legend: { bgcolor: "rgba(0,0,0,0)" },
    },
  } };
}

// Streamlit's chart element offers a fullscreen view; so does this one (the browser's Fullscreen API on the plot).
const FULLSCREEN_ICON = { width: 1000, height: 1000,
  path: "M0 0h400v100H100v300H0zM600 0h400v400H900V100H600zM0 600h100v300h300v100H0zM900 600h100v400H600V900h300z" };

// How far outside the visible part of the page a figure is drawn ahead of the scroll.
const VISIBLE_MARGIN = "200px 0px";

function toggleFullscreen(plot) {
  if (document.fullscreenElement === plot) document.exitFullscreen();
  else plot.requestFullscreen();
}

function scrollingAncestor(element) {
  // The box the page scrolls in (Streamlit scrolls its main area, not the document), or null: the viewport.
  for (let node = element.parentElement; node; node = node.parentElement) {
    if (/(auto|scroll|overlay)/.test(getComputedStyle(node).overflowY)) return node;
  }
  return null;
}

function draw(plot) {
  // The figure last given to `plot` (plot.pending), drawn once plotly.js is there; the next rerun's figure is drawn
  // over it in place (Plotly.react).
  const { data, setTriggerValue, element } = plot.pending;
  plot.pending = null;
  plotlyLoaded(data.script).then((Plotly) => {
    const shapes = JSON.parse(data.shapes);
    const template = themeTemplate(element);
    const drawnAs = JSON.stringify([template.plotly, data.config, data.clickable]) + data.figure;
    if (plot.drawnAs === drawnAs) {
      // The figure as drawn but for its shapes (the Token inspector's window on its strip): they alone are moved,
      // in about a millisecond; Plotly.react redraws the whole figure for them (40-80 ms).
      return Plotly.relayout(plot, { shapes });
    }
    plot.drawnAs = undefined;  // until drawn
    const figure = JSON.parse(data.figure);
    plot.heightOfFigure = figure.layout.height;
    plot.backgroundOfTheme = template.background;  // what a full-screen figure is drawn on
    const layout = { ...figure.layout, shapes, template: template.plotly };
    const config = { displaylogo: false, showSendToCloud: false,
                     modeBarButtonsToAdd: [{ name: "fullscreen", title: "Full screen (Esc to leave)",
                                             icon: FULLSCREEN_ICON, click: toggleFullscreen }],
                     ...data.config };
    return Plotly.react(plot, figure.data, layout, config).then(() => {
      plot.drawnAs = drawnAs;
      plot.style.minHeight = "";  // the placeholder's height (below): the plot has its own now
      plot.removeAllListeners?.("plotly_click");
      if (data.clickable) {
        plot.on("plotly_click", (event) => {
          const point = event.points[0];
          if (point) setTriggerValue("click", { x: point.x, y: point.y, curve: point.curveNumber });
        });
      }
    });
  }).catch((error) => {
    plot.textContent = `This figure could not be drawn: ${error.message}`;
  });
}

export default function (component) {
  const { data, parentElement, setTriggerValue } = component;
  let plot = parentElement.querySelector("div.policylens-figure");
  if (!plot) {
    plot = document.createElement("div");
    plot.className = "policylens-figure";
    plot.style.width = "100%";
    // Until it is drawn, the figure keeps its place (its height, plotly's default 450 px): what follows does not
    // move when it is drawn, and figures further down stay out of sight.
    plot.style.minHeight = `${JSON.parse(data.figure).layout?.height ?? 450}px`;
    parentElement.appendChild(plot);
    // Follows the column's width; an observer of a removed figure goes with it (a window listener would not).
    new ResizeObserver(() => {
      if (plot._fullLayout && window.Plotly) window.Plotly.Plots.resize(plot);
    }).observe(plot);
    // Full screen, the figure takes the screen's height and the theme's background; back, its own height
    // (`heightOfFigure`, kept at each draw) and none.
    plot.addEventListener("fullscreenchange", () => {
      const full = document.fullscreenElement === plot;
      plot.style.background = full ? plot.backgroundOfTheme : "";
      window.Plotly?.relayout(plot, { height: full ? window.innerHeight : plot.heightOfFigure ?? null });
    });
    // Drawn when it comes within VISIBLE_MARGIN of the screen: a page's figures below the fold (or in a closed
    // expander) cost the browser nothing until the user scrolls to them; a figure out of sight that a rerun
    // changes is drawn when it comes back.
    new IntersectionObserver((entries) => {
      plot.visible = entries[entries.length - 1].isIntersecting;
      if (plot.visible && plot.pending) draw(plot);
    }, { root: scrollingAncestor(parentElement), rootMargin: VISIBLE_MARGIN }).observe(plot);
    // plotly.js itself is fetched and run once the browser is idle, figures in sight or not: a page whose figures
    // are all further down (PRM steps under a long completion's text) would otherwise make the first one scrolled
    // to wait for it (0.3 s on two cores). A failure is reported by the first draw, which tries again.
    (window.requestIdleCallback ?? setTimeout)(() => plotlyLoaded(data.script).catch(() => {}));
  }
  plot.pending = { data, setTriggerValue, element: parentElement };
  if (plot.visible) draw(plot);
}
