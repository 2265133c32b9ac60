/*
 * export_svg.c - a standalone SVG timeline of a simulated schedule, drawn like the figures of the
 * Zero Bubble paper (Qi et al., 2023): one row per rank, time to the right, one box per op coloured
 * by its type, the microbatch number in the box.
 *
 * The picture is at least WIDTH pixels wide and grows with the schedule, so the shortest op keeps
 * room for its microbatch number (up to MAX_WIDTH; past it numbers drop out where they do not
 * fit); its height grows with p. A schedule given a time span (zb_schedule_set_display) is drawn
 * at WIDTH over that span instead, so pictures given the same span share one scale. The title
 * names the schedule and its figures: the step (makespan), the paper's bubble rate and the idle
 * share of all ranks' time, which differ where the busiest rank never waits but the others do
 * at the step's ends. Later chunks of a V or interleaved schedule use darker shades of their type's colour.
 * A schedule with copies (PipeOffload) gets a thinner lane under every rank's row for its OFFLOAD
 * and RELOAD ops, which run beside the compute.
 *
 * What this is not: an interactive view (use the chrome format in Perfetto for that) or a plotting
 * library. It writes SVG 1.1 text only; any text it places is XML-escaped.
 */
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "internal.h"

#define WIDTH 1200.0
#define MAX_WIDTH 16000.0
#define MIN_OP_PX 16.0 /* the shortest op's width, room for a two-digit microbatch number */
#define LEFT 70.0  /* room for "rank 12" */
#define RIGHT 20.0
#define TOP 82.0   /* title, figures and legend sit above the rows */

typedef struct {
  unsigned char r, g, b;
} rgb_t;

/* Light shade (chunk 0) and dark shade (last chunk) per op type, indexed by zb_op_type_t. BW is a
 * darker blend of B's teal and W's green, so a fused backward reads as "both". */
#define NTYPES 10
static const rgb_t light[NTYPES] = {{0x9f, 0xc5, 0xe8}, {0x7f, 0xd6, 0xd6}, {0xb6, 0xd7, 0xa8}, {0x7b, 0xab, 0x99},
                                    {0xf6, 0xc0, 0x8c}, {0xc9, 0xb3, 0xe6}, {0xf4, 0xa6, 0xa6}, {0xe8, 0x8c, 0x8c},
                                    {0xf2, 0xe0, 0x8f}, {0xe0, 0xc8, 0x6e}};
static const rgb_t dark[NTYPES] = {{0x3d, 0x78, 0xb5}, {0x2b, 0x9a, 0x9a}, {0x5f, 0x9e, 0x48}, {0x3e, 0x7a, 0x68},
                                   {0xc8, 0x6a, 0x1a}, {0x7a, 0x55, 0xb0}, {0xf4, 0xa6, 0xa6}, {0xe8, 0x8c, 0x8c},
                                   {0xf2, 0xe0, 0x8f}, {0xe0, 0xc8, 0x6e}};
static const char *const type_label[NTYPES] = {"F forward", "B input-grad backward", "W weight-grad backward",
                                               "BW fused backward", "offload to host", "reload",
                                               "S vocabulary forward", "T vocabulary backward",
                                               "IF embedding forward", "IB embedding backward"};

static rgb_t op_colour(int type, int chunk, int v) {
  double t = v > 1 ? (double)chunk / (v - 1) : 0;
  if (type < 0 || type >= NTYPES) type = ZB_OP_BW;
  rgb_t a = light[type], z = dark[type];
  rgb_t c = {(unsigned char)(a.r + (z.r - a.r) * t + 0.5), (unsigned char)(a.g + (z.g - a.g) * t + 0.5),
             (unsigned char)(a.b + (z.b - a.b) * t + 0.5)};
  return c;
}

/* Writes text with &, <, >, " and ' escaped, dropping control bytes XML 1.0 does not allow. */
static void put_xml(zb__sbuf_t *b, const char *str) {
  for (const unsigned char *c = (const unsigned char *)(str ? str : ""); *c; c++) {
    switch (*c) {
      case '&': zb__sbuf_printf(b, "&amp;"); break;
      case '<': zb__sbuf_printf(b, "&lt;"); break;
      case '>': zb__sbuf_printf(b, "&gt;"); break;
      case '"': zb__sbuf_printf(b, "&quot;"); break;
      case '\'': zb__sbuf_printf(b, "&apos;"); break;
      default:
        if (*c >= 0x20 || *c == '\t' || *c == '\n') zb__sbuf_putc(b, (char)*c);
    }
  }
}

/* A finite coordinate: non-finite times (only possible with absurd costs) collapse to the left. */
static double fin(double x) { return isfinite(x) ? x : 0; }


zb_status_t zb__export_svg(const zb_schedule_t *s, char **out, size_t *len) {
  double origin = INFINITY, last = -INFINITY;
  int used[NTYPES] = {0}, copies = 0;
  for (int k = 0; k < s->n_ops; k++) {
    if (s->start[k] < origin) origin = s->start[k];
    if (s->end[k] > last) last = s->end[k];
    int t = s->ops[k].type;
    if (t >= 0 && t < NTYPES) used[t] = 1;
    copies += zb__op_is_copy(t);
  }
  if (!isfinite(origin)) origin = 0;
  double extent = last - origin;
  if (!(extent > 0) || !isfinite(extent)) extent = 1;
  double shortest = INFINITY;
  for (int k = 0; k < s->n_ops; k++) {
    double d = s->end[k] - s->start[k];
    if (d > 0 && d < shortest && !zb__op_is_copy(s->ops[k].type)) shortest = d;
  }
  double width = WIDTH, plot_w = WIDTH - LEFT - RIGHT, scale;
  if (s->disp_span > 0) {
    /* A shared scale: this span across WIDTH; ops past it are drawn up to the right edge. */
    extent = s->disp_span;
    scale = plot_w / extent;
  } else {
    scale = plot_w / extent;
    if (isfinite(shortest) && shortest * scale < MIN_OP_PX) {
      scale = fmin(MIN_OP_PX / shortest, (MAX_WIDTH - LEFT - RIGHT) / extent);
      plot_w = extent * scale;
      width = ceil(LEFT + plot_w + RIGHT);
    }
  }

  /* Rows keep a readable height up to 16 ranks, then share about 420 px. */
  double row_h = s->p <= 16 ? 26 : fmax(4, 420.0 / s->p);
  double gap = row_h >= 10 ? 3 : 1;
  double lane_h = copies ? fmax(3, 0.55 * row_h) : 0; /* the copy lane under each rank's row */
  double pitch = row_h + lane_h + gap;
  double axis_y = TOP + s->p * pitch + 4;
  double height = axis_y + 36;

  zb__sbuf_t b = {0};
  zb__sbuf_printf(&b,
                  "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"%.0f\" height=\"%.0f\" "
                  "viewBox=\"0 0 %.0f %.0f\" font-family=\"Helvetica, Arial, sans-serif\">\n",
                  width, height, width, height);
  zb__sbuf_printf(&b, "<rect class=\"bg\" x=\"0\" y=\"0\" width=\"%.0f\" height=\"%.0f\" "
                      "fill=\"white\"/>\n",
                  width, height);

  /* Title. */
  char title[512], figures[512];
  snprintf(title, sizeof title, "%s, p=%d v=%d m=%d", zb__display_name(s), s->p, s->v, s->m);
  double makespan, idle;
  zb__step_idle(s, &makespan, &idle);
  const char *unit = s->disp_unit ? s->disp_unit : "";
  snprintf(figures, sizeof figures,
           "step %.6g%s%s; bubble %.2f%% (the paper's: the busiest rank's idle share of its span); idle %.2f%% "
           "(of all ranks' time over the step); peak memory %.4g microbatches",
           makespan, unit[0] ? " " : "", unit, 100 * s->sim.bubble_rate, 100 * idle, s->sim.max_peak_memory);
  zb__sbuf_printf(&b, "<text x=\"%.0f\" y=\"22\" font-size=\"15\" font-weight=\"bold\">", LEFT);
  put_xml(&b, title);
  zb__sbuf_printf(&b, "</text>\n<text class=\"figures\" x=\"%.0f\" y=\"42\" font-size=\"12\">", LEFT);
  put_xml(&b, figures);
  zb__sbuf_printf(&b, "</text>\n");

  /* Legend: one swatch per op type present, then a note on chunk shades. */
  double lx = LEFT;
  for (int t = 0; t < NTYPES; t++) {
    if (!used[t]) continue;
    rgb_t c = op_colour(t, 0, 1);
    zb__sbuf_printf(&b,
                    "<rect class=\"key\" x=\"%.1f\" y=\"54\" width=\"14\" height=\"14\" "
                    "fill=\"#%02x%02x%02x\"/><text x=\"%.1f\" y=\"65\" font-size=\"12\">",
                    lx, c.r, c.g, c.b, lx + 18);
    put_xml(&b, type_label[t]);
    zb__sbuf_printf(&b, "</text>\n");
    /* No text metrics in SVG 1.1: estimate 12 px Helvetica at about 6.8 px per character. */
    lx += 18 + 6.8 * (double)strlen(type_label[t]) + 18;
  }
  if (s->v > 1) {
    zb__sbuf_printf(&b, "<text x=\"%.1f\" y=\"65\" font-size=\"12\" fill=\"#555\">", lx);
    put_xml(&b, "darker shade = later chunk; number = microbatch");
  } else {
    zb__sbuf_printf(&b, "<text x=\"%.1f\" y=\"65\" font-size=\"12\" fill=\"#555\">", lx);
    put_xml(&b, "number = microbatch");
  }
  zb__sbuf_printf(&b, "</text>\n");

  /* Rows. */
  for (int r = 0; r < s->p; r++) {
    double y0 = TOP + r * pitch;
    zb__sbuf_printf(&b,
                    "<text x=\"%.0f\" y=\"%.1f\" font-size=\"%.1f\" text-anchor=\"end\" "
                    "dominant-baseline=\"central\">rank %d</text>\n",
                    LEFT - 8, y0 + row_h / 2, fmin(13, fmax(4, row_h * 0.7)), r);
    for (int k = s->rank_off[r]; k < s->rank_off[r + 1]; k++) {
      const zb_op_t *op = &s->ops[k];
      int copy = zb__op_is_copy(op->type);
      double y = copy ? y0 + row_h + 1 : y0, h = copy ? lane_h - 1 : row_h;
      double x = LEFT + fin((s->start[k] - origin) * scale);
      double w = fin((s->end[k] - s->start[k]) * scale);
      if (x > width - RIGHT) x = width - RIGHT;
      if (w < 0) w = 0;
      if (x + w > width - RIGHT) w = width - RIGHT - x; /* past a shared span: up to the edge */
      rgb_t c = op_colour(op->type, zb__op_is_vocab(op->type) ? 0 : zb__stage_chunk(s, op->stage), s->v);
      zb__sbuf_printf(&b,
                      "<rect class=\"%s\" x=\"%.2f\" y=\"%.1f\" width=\"%.2f\" height=\"%.1f\" "
                      "fill=\"#%02x%02x%02x\" stroke=\"white\" stroke-width=\"%.2f\"/>\n",
                      copy ? "copy" : "op", x, y, w, h, c.r, c.g, c.b, w >= 4 ? 1.0 : 0.25);
      /* The number, sized to the box; left out only where even a 6 px digit would not fit. */
      char num[16];
      int nd = snprintf(num, sizeof num, "%d", (int)op->mb);
      double font = fmin(13, fmin(h * 0.62, (w - 1) / (0.62 * nd)));
      if (font >= 6) {
        /* Dark shades get white text, light ones black (relative luminance, ITU-R BT.709). */
        double lum = 0.2126 * c.r + 0.7152 * c.g + 0.0722 * c.b;
        zb__sbuf_printf(&b,
                        "<text x=\"%.2f\" y=\"%.1f\" font-size=\"%.1f\" text-anchor=\"middle\" "
                        "dominant-baseline=\"central\" fill=\"%s\">%s</text>\n",
                        x + w / 2, y + h / 2, font, lum < 140 ? "white" : "black", num);
      }
    }
  }

  /* Time axis with round ticks. */
  zb__sbuf_printf(&b,
                  "<line x1=\"%.0f\" y1=\"%.1f\" x2=\"%.0f\" y2=\"%.1f\" stroke=\"#333\" "
                  "stroke-width=\"1\"/>\n",
                  LEFT, axis_y, width - RIGHT, axis_y);
  double step = zb__nice_step(extent / fmax(8, floor(plot_w / 150)));
  for (int i = 0; i <= 1000; i++) {
    double t = i * step;
    if (t > extent * (1 + 1e-9)) break;
    double x = LEFT + t * scale;
    zb__sbuf_printf(&b,
                    "<line x1=\"%.2f\" y1=\"%.1f\" x2=\"%.2f\" y2=\"%.1f\" stroke=\"#333\" "
                    "stroke-width=\"1\"/><text x=\"%.2f\" y=\"%.1f\" font-size=\"11\" "
                    "text-anchor=\"middle\">%g</text>\n",
                    x, axis_y, x, axis_y + 5, x, axis_y + 18, origin + t);
  }
  char axis[256];
  snprintf(axis, sizeof axis, "time%s%s%s", unit[0] ? " (" : " (the costs' unit", unit, ")");
  zb__sbuf_printf(&b,
                  "<text x=\"%.0f\" y=\"%.1f\" font-size=\"11\" text-anchor=\"end\" "
                  "fill=\"#555\">",
                  width - RIGHT, axis_y + 32);
  put_xml(&b, axis);
  zb__sbuf_printf(&b, "</text>\n");
  zb__sbuf_printf(&b, "</svg>\n");
  return zb__sbuf_finish(&b, out, len);
}
